"""Serving: the canary router server, its config, state, metrics and feedback endpoint."""
