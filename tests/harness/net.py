"""Loopback ports for the servers tests start."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now (the kernel's pick); a server bound to it
    later may race another, which the tests accept for loopback."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
