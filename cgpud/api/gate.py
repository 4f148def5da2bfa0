"""The admin socket's door: only root gets through to the gRPC server.

grpcio's Python API never shows a server the peer's SO_PEERCRED, so cgpud
binds the public socket itself, checks each accepted connection's
credentials, and copies an accepted connection's bytes to and from the gRPC
server, which listens on a private socket in a 0700 directory. A refused
peer gets one text line and the connection closes; cgpuctl's probe reads
that line to tell the user why (cgpud.cli.client.unreachable).

File modes (0600 socket, 0700 directory) already keep ordinary users out;
this check also holds for a process with CAP_DAC_OVERRIDE but not root, a
socket directory an operator opened up, or an fd passed to another user.

Thread-safety: start() and stop() from one thread; one accept thread and two
copying threads per connection, each owning its sockets."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import structlog

from cgpud.api import REFUSAL_PREFIX
from cgpud.errors import CgpuError
from cgpud.sockets import owner_only_listening

MAX_CONNECTIONS = 64  # admin clients are cgpuctl and node agents: a handful
_CHUNK = 1 << 16


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it at connect()."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def private_socket_path(public: Path) -> Path:
    """Where the gRPC server listens behind the gate: beside the public
    socket, in a directory only cgpud's user may enter."""
    return public.parent / ".api" / public.name


def prepare_private_directory(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise CgpuError(f"cannot serve in {directory}: not a directory of this user; remove it")
    os.chmod(directory, 0o700)


class PeerGate:
    def __init__(self, public: Path, private: Path, log: Any | None = None) -> None:
        self._public = public
        self._private = private
        self._allowed = frozenset({0, os.geteuid()})
        self._log = log or structlog.get_logger("cgpud.api")
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._stopping = False
        self._stopped = threading.Event()

    def start(self) -> PeerGate:
        """Binds the public socket (0600 from the start) and accepts on it."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with owner_only_listening(self._public):
                listener.bind(str(self._public))
                listener.listen(64)
        except CgpuError:
            listener.close()
            raise
        self._listener = listener
        self._thread = threading.Thread(target=self._accept_loop, name="cgpud-api-gate", daemon=True)
        self._thread.start()
        return self

    def stop_accepting(self) -> None:
        """New connections fail; open ones go on (a graceful stop's in-flight calls)."""
        with self._lock:
            self._stopping = True
        self._stopped.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            self._listener.close()
            self._public.unlink(missing_ok=True)
            self._listener = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def stop(self) -> None:
        self.stop_accepting()
        with self._lock:
            conns = list(self._open)
        for c in conns:
            _shutdown(c)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as e:
                with self._lock:
                    if self._stopping:
                        return
                # Out of descriptors, say: do not spin on a full table.
                self._log.error("cannot accept on the admin socket", error=str(e))
                self._stopped.wait(0.1)
                continue
            try:
                self._admit(conn)
            except Exception:  # one bad connection must not stop the door
                self._log.exception("admin connection failed")
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        pid, uid, gid = peer_credentials(conn)
        if uid not in self._allowed:
            self._log.warning("refused a non-root admin client", socket=str(self._public), pid=pid, uid=uid, gid=gid)
            _refuse(conn, f"only root may use {self._public} (the connecting process runs as uid {uid})")
            return
        with self._lock:
            busy = len(self._open) >= 2 * MAX_CONNECTIONS
        if busy:
            self._log.warning("refused an admin client: too many connections", pid=pid, uid=uid)
            _refuse(conn, f"too many admin connections on {self._public}; try again")
            return
        backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            backend.connect(str(self._private))
        except OSError as e:
            backend.close()
            self._log.error("the gRPC server behind the admin socket is gone", error=str(e))
            _refuse(conn, f"cgpud's API is not serving ({e.strerror}); try again")
            return
        with self._lock:
            self._open.update((conn, backend))
        pair = _Pair(conn, backend, self._forget)
        for src, dst in ((conn, backend), (backend, conn)):
            threading.Thread(target=pair.copy, args=(src, dst), name="cgpud-api-copy", daemon=True).start()

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.difference_update(socks)


class _Pair:
    """Two sockets copied both ways; closed when both directions ended."""

    def __init__(self, a: socket.socket, b: socket.socket, forget: Any) -> None:
        self._a, self._b = a, b
        self._forget = forget
        self._lock = threading.Lock()
        self._left = 2

    def copy(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            # One side reset: end both directions now.
            _shutdown(src)
            _shutdown(dst)
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            self._forget(self._a, self._b)
            self._a.close()
            self._b.close()


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _refuse(conn: socket.socket, message: str) -> None:
    try:
        conn.settimeout(1.0)
        conn.sendall(REFUSAL_PREFIX + message.encode() + b"\n")
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        conn.close()
