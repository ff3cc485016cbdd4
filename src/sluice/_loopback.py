"""A free TCP port on loopback, for the servers Sluice starts for itself.

SUMMARY
    free_port(host="127.0.0.1") -> int

DESCRIPTION
    The demo, the cluster's Redis and the test PostgreSQL each start a
    server of their own on a loopback port nobody uses.  Binding port 0
    and reading what the kernel gave is the one way to learn such a port;
    the socket is closed at once, so a race with another process taking
    it in between is possible, and the caller's server fails to start with
    "address already in use" if one does.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
