"""Loopback ports for the servers tests start."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now (the kernel's pick); a server bound to it
    later may race another, which the tests accept for loopback."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def send_json(handler: BaseHTTPRequestHandler, code: int, data: bytes) -> None:
    """An HTTP answer of JSON bytes, for the API servers tests play."""
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[int]:
    """`server` answering on a thread for the block; its port."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
