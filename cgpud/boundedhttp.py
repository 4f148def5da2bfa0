"""HTTP servers a flood cannot wedge: the extender's and cgpud's metrics.

socketserver's threading servers give every connection a thread for as
long as the peer keeps it open and read a body of any announced size into
one allocation. Three bounds close that:

- at most `max_connections` connections; a new one past the cap closes the
  longest-idle connection that is not being answered (a flood of idle or
  stalled connections cannot keep out a scrape, /healthz or kube-scheduler),
  and is itself refused only when every connection is being answered;
- a connection that is not being answered (idle keep-alive, a request or a
  TLS handshake still arriving, a stalled body) is closed `idle_timeout`
  after it went idle, whatever it trickles meanwhile;
- request bodies are read in pieces, against one `body_budget` of bytes all
  connections share: a request whose body does not fit in what is left is
  answered 503 at once, without reading it.

Thread-safety: a ConnectionTable is shared by the accepting thread, the
handler threads and its reaper (one lock); Budget likewise.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

READ_PIECE = 64 << 10


@dataclass(frozen=True)
class Bounds:
    max_connections: int = 64
    idle_timeout: float = 30.0  # seconds a connection may spend not being answered
    body_budget: int = 64 << 20  # bytes of request bodies held at once, all connections together

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.idle_timeout <= 0 or self.body_budget < 0:
            raise ValueError(f"bad HTTP server bounds: {self}")


@dataclass
class _Conn:
    sock: socket.socket
    since: float  # when it last went idle (or was accepted)
    busy: bool = False


def _cut(sock: socket.socket) -> None:
    """End a connection another thread may be reading: shutdown (not close)
    wakes that reader with EOF, and its thread closes the socket. The plain
    socket's shutdown, also for TLS: SSLSocket's own would drop the TLS
    state under the reader's feet."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class ConnectionTable:
    def __init__(self, bounds: Bounds, clock: Callable[[], float] = time.monotonic) -> None:
        self._bounds = bounds
        self._clock = clock
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}

    def admit(self, sock: socket.socket) -> bool:
        """Room for `sock`, made by cutting the longest-idle connection when
        at the cap; False when every connection is being answered."""
        with self._lock:
            victim = None
            if len(self._conns) >= self._bounds.max_connections:
                idle = [c for c in self._conns.values() if not c.busy]
                if not idle:
                    return False
                victim = min(idle, key=lambda c: c.since)
                del self._conns[id(victim.sock)]
            self._conns[id(sock)] = _Conn(sock, self._clock())
        if victim is not None:
            _cut(victim.sock)
        return True

    def busy(self, sock: socket.socket) -> None:
        with self._lock:
            conn = self._conns.get(id(sock))
            if conn is not None:
                conn.busy = True

    def idle(self, sock: socket.socket) -> None:
        with self._lock:
            conn = self._conns.get(id(sock))
            if conn is not None:
                conn.busy, conn.since = False, self._clock()

    def leave(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.pop(id(sock), None)

    def reap(self) -> int:
        """Cut the connections idle for longer than the bound; how many."""
        now = self._clock()
        with self._lock:
            old = [c for c in self._conns.values() if not c.busy and now - c.since > self._bounds.idle_timeout]
            for c in old:
                del self._conns[id(c.sock)]
        for c in old:
            _cut(c.sock)
        return len(old)

    def __len__(self) -> int:
        with self._lock:
            return len(self._conns)


class Budget:
    """Bytes that may be held at once; taken without waiting."""

    def __init__(self, total: int) -> None:
        self._lock = threading.Lock()
        self._left = total

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self._left:
                return False
            self._left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._left += n


if TYPE_CHECKING:
    # What the mixins are mixed into, so that mypy checks their calls to it.
    class _ServerBase(socketserver.ThreadingMixIn, socketserver.TCPServer): ...

    _HandlerBase = socketserver.StreamRequestHandler
else:
    _ServerBase = socketserver.ThreadingMixIn
    _HandlerBase = object


class BoundedServer(_ServerBase):
    """Mixed in before a socketserver TCP server class; its handler should
    mix in BoundedHandler. Call `start_reaper()` after construction and
    `server_close()` at the end, as for any socketserver server."""

    daemon_threads = True
    bounds = Bounds()

    def _bounded(self) -> tuple[ConnectionTable, Budget]:
        table = getattr(self, "_table", None)
        if table is None:
            table = self._table = ConnectionTable(self.bounds)
            self._budget = Budget(self.bounds.body_budget)
            self._reaper_stop = threading.Event()
        return table, self._budget

    @property
    def connections(self) -> ConnectionTable:
        return self._bounded()[0]

    @property
    def budget(self) -> Budget:
        return self._bounded()[1]

    def start_reaper(self) -> None:
        table, _ = self._bounded()
        stop = self._reaper_stop
        every = min(1.0, self.bounds.idle_timeout / 4)

        def run() -> None:
            while not stop.wait(every):
                table.reap()

        threading.Thread(target=run, name="http-reaper", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.admit(request):
            self.shutdown_request(request)  # everything is being answered: this one waits for nobody
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.leave(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a peer that went away, or was cut: nothing to print to stderr

    def server_close(self) -> None:
        self._bounded()
        self._reaper_stop.set()
        super().server_close()


class BoundedHandler(_HandlerBase):
    """Mixed in before a StreamRequestHandler class served by a
    BoundedServer: sockets time out at the idle bound, `answering()` marks
    the connection busy and `answered()` idle again, `body()` reads a body."""

    server: BoundedServer
    request: socket.socket
    rfile: Any

    def setup(self) -> None:
        # Each read waits at most this. typeshed declares timeout a ClassVar;
        # StreamRequestHandler.setup reads it from the instance.
        self.timeout = self.server.bounds.idle_timeout  # type: ignore[misc]
        super().setup()

    def answering(self) -> None:
        """The request is in: what follows is ours, not the peer's, to finish."""
        self.server.connections.busy(self.request)

    def answered(self) -> None:
        self.server.connections.idle(self.request)

    @contextmanager
    def body(self, length: int) -> Iterator[bytes | None]:
        """The body, read in pieces against the shared budget and counted
        in it while the block holds it; None when the budget has no room
        for it now (answer 503 without reading it)."""
        budget = self.server.budget
        if not budget.take(length):
            yield None
            return
        try:
            parts, left = [], length
            while left:
                piece = self.rfile.read1(min(READ_PIECE, left))
                if not piece:
                    raise ConnectionError("the peer closed the connection inside a request body")
                parts.append(piece)
                left -= len(piece)
            yield b"".join(parts)
        finally:
            budget.give(length)
