"""Loopback ports for the servers tuneloop starts itself (MLflow, routers, backends)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now (the OS picks it; another process may take it after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
