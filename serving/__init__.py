"""Serving: backend launch commands, the canary router and its release-facing endpoints."""
