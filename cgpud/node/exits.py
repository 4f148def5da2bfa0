"""Learning at once that a container's init process exited: a pidfd per
bound container, polled by one thread, so its instance is released (or a
claimed one handed back) when the container stops, not at the next sweep
and with no poststop hook or runtime release on the start path.

A pidfd names one process, never a PID reused later: it is opened at bind,
while the init waits in runc for `start`, so what it names is that init.
The callback runs on the watch's thread (or on a caller's, in settle());
each exit is handed to exactly one of them.

Kernels before 5.3 (RHEL 8's 4.18) have no pidfd_open: the watch says so
once and watches nothing; the sweep finds each exit instead.

ExitWatch may be shared by threads: its table has its own lock, and the
callback is called without it."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

# An exit is a (instance id, pid) pair: the callback checks the instance is
# still bound to that pid before it changes anything.
OnExit = Callable[[str, int], None]


@dataclass(frozen=True)
class _Watched:
    instance_id: str
    pid: int


class ExitWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_fd: dict[int, _Watched] = {}
        self._fd_of: dict[str, int] = {}
        self._gone: list[_Watched] = []  # exited before a pidfd could be opened
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._on_exit: OnExit | None = None
        self._closed = False
        self._pidfds = True  # False once the kernel has said it has no pidfd_open
        self._log = structlog.get_logger("cgpud.exits")

    def watch(self, instance_id: str, pid: int, pidfd: int | None = None) -> None:
        """Watches `pid` for the instance, instead of any pid watched for it.
        `pidfd`: one the caller already opened on `pid`; the watch owns it."""
        if pidfd is None and not self._pidfds:
            self.forget(instance_id)
            return
        try:
            fd: int | None = pidfd if pidfd is not None else os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None
        except OSError as e:
            self.forget(instance_id)
            if e.errno == errno.ENOSYS:
                with self._lock:
                    first, self._pidfds = self._pidfds, False
                if first:
                    self._log.info(
                        "this kernel has no pidfd_open (Linux 5.3): containers' exits are found by the sweep"
                    )
                return
            # EMFILE and the like: the sweep still finds it gone
            self._log.warning(
                "cannot watch the init process; the sweep will notice its exit", id=instance_id, pid=pid, error=str(e)
            )
            return
        with self._lock:
            if self._closed:
                if fd is not None:
                    os.close(fd)
                return
            self._forget_locked(instance_id)
            if fd is None:  # gone already: told on the watch's thread, as any exit
                self._gone.append(_Watched(instance_id, pid))
                with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
                    os.write(self._wake_w, b"x")
                return
            self._by_fd[fd] = _Watched(instance_id, pid)
            self._fd_of[instance_id] = fd
            self._epoll.register(fd, select.EPOLLIN)

    def forget(self, instance_id: str) -> None:
        with self._lock:
            if not self._closed:
                self._forget_locked(instance_id)

    def _forget_locked(self, instance_id: str) -> None:
        fd = self._fd_of.pop(instance_id, None)
        if fd is not None:
            del self._by_fd[fd]
            self._epoll.unregister(fd)
            os.close(fd)

    def watching(self) -> dict[str, int]:
        """Instance id -> watched pid."""
        with self._lock:
            return {w.instance_id: w.pid for w in self._by_fd.values()}

    def settle(self) -> bool:
        """Hands every exit that is ready now to the callback, on this
        thread: a start refused for room can retry once the instances of
        containers that just stopped are back. True if there was any."""
        return bool(self._collect(0.0))

    def handle_with(self, on_exit: OnExit) -> None:
        """Who is told of exits; start() sets it too. Without a thread
        (tests), only settle() hands exits on."""
        self._on_exit = on_exit

    def start(self, on_exit: OnExit, stop: threading.Event) -> threading.Thread:
        """Hands exits to `on_exit` on a thread of its own until `stop`."""
        self.handle_with(on_exit)

        def run() -> None:
            while not stop.is_set():
                self._collect(1.0)
            self.close()

        thread = threading.Thread(target=run, name="cgpud-exits", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in self._by_fd:
                os.close(fd)
            self._by_fd.clear()
            self._fd_of.clear()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._epoll.close()

    def _collect(self, timeout: float) -> list[_Watched]:
        try:
            ready = self._epoll.poll(timeout)
        except (InterruptedError, ValueError):  # ValueError: closed meanwhile
            return []
        exited: list[_Watched] = []
        with self._lock:
            if self._closed:
                return []
            for fd, _ in ready:
                if fd == self._wake_r:
                    while True:
                        try:
                            if not os.read(self._wake_r, 64):
                                break
                        except BlockingIOError:
                            break
                    continue
                watched = self._by_fd.pop(fd, None)
                if watched is None:  # another thread took it, or it was forgotten
                    continue
                del self._fd_of[watched.instance_id]
                self._epoll.unregister(fd)
                os.close(fd)
                exited.append(watched)
            exited.extend(self._gone)
            self._gone.clear()
        if exited and self._on_exit is not None:
            for w in exited:
                try:
                    self._on_exit(w.instance_id, w.pid)
                except Exception:  # one instance's trouble never stops the watch
                    self._log.exception("handling an init's exit failed", id=w.instance_id, pid=w.pid)
        return exited
