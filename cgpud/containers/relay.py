"""The relay socket: where cgpu-runtime and cgpu-hook (small C programs on
the container start path) hand their work to cgpud. The wire format is
described in csrc/include/cgpu/relay_wire.h, whose limits this side reads
through cgpud.contract.

Only root may talk here (SO_PEERCRED): the verbs create instances and edit
bundles anywhere on the host."""

from __future__ import annotations

import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import structlog

from cgpud.contract import RELAY_MAX_REQUEST, RELAY_MSG_MAX, RELAY_SHIM_BINDS, RELAY_SPEC_FD
from cgpud.errors import CgpuError, UsageError
from cgpud.containers.edits import BIND_STAGE, RELEASE_STAGE
from cgpud.containers.lifecycle import BIND_STAGES, ContainerLifecycle
from cgpud.sockets import owner_only_listening, prepare_socket_directory, remove_stale_socket

# Requests are handled one at a time (RelayServer), so a client that
# connects and stalls holds the others up to this long. The relays send
# their whole request right after connecting.
READ_TIMEOUT = 2.0
# Verbs counted by name in metrics; anything else (a malformed request) is "other".
_VERBS = ("prepare", "bind", "release", *(f"hook {stage}" for stage in (*BIND_STAGES, RELEASE_STAGE)))
# The flags of prepare. shim-binds: the shim binds after create and releases
# after delete itself, so cgpud writes no hook entries. spec-fd: the spec
# comes as the request's one file descriptor (the shim has put a FIFO at
# config.json for the runtime to wait on; relay_wire.h).
_PREPARE_FLAGS: tuple[list[str], ...] = ([], [RELAY_SHIM_BINDS], [RELAY_SHIM_BINDS, RELAY_SPEC_FD])


class RelayProtocolError(UsageError):
    """The request does not follow the relay wire format."""


def _read_request(conn: socket.socket, fds: list[int]) -> tuple[list[str], bytes]:
    """The request's words and body; file descriptors passed with it are
    appended to `fds` (the caller closes them; more than one is refused,
    the kernel closing the rest)."""
    chunks: list[bytes] = []
    size = 0
    too_many = False
    while True:
        chunk, passed, flags, _ = socket.recv_fds(conn, 65536, 1)
        fds.extend(passed)
        too_many = too_many or bool(flags & socket.MSG_CTRUNC) or len(fds) > 1
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > RELAY_MAX_REQUEST:
            raise RelayProtocolError(f"request larger than {RELAY_MAX_REQUEST} bytes")
    if too_many:  # read to its end first, so the answer is not lost to a reset
        raise RelayProtocolError("more than one file descriptor came with the request")
    data = b"".join(chunks)
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise RelayProtocolError("request has no header line")
    try:
        words = head.decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise RelayProtocolError("request header is not ASCII") from None
    return words, body


def answer_line(text: str) -> bytes:
    """`text` as one answer line the relays read whole: a longer one would
    reach the user as "answer too long" instead of the message."""
    data = text.replace("\n", " ").encode()[: RELAY_MSG_MAX - 1]
    return data.decode(errors="ignore").encode() + b"\n"  # no character cut in half


def handle(
    lifecycle: ContainerLifecycle,
    words: list[str],
    body: bytes,
    decided: Callable[[str], None] = lambda text: None,
    fds: tuple[int, ...] = (),
) -> str:
    """One request to one answer text; raises CgpuError for the error line.
    A bind or a release calls `decided(text)` with its answer before the
    work that cannot change it (InstanceService.bind_container,
    container_stopped), so the runtime need not wait for that. `fds`: the
    file descriptors that came with the request (only prepare spec-fd takes
    one)."""
    spec_fd = words[3:] == [RELAY_SPEC_FD] and words[:1] == ["prepare"]
    if len(fds) != spec_fd:
        raise RelayProtocolError(
            "prepare spec-fd came without the spec's file descriptor"
            if spec_fd
            else "a file descriptor came with a request that takes none"
        )
    match words:
        case ["prepare", container_id, *flags] if flags in _PREPARE_FLAGS:
            try:
                bundle = Path(os.fsdecode(body))
            except (UnicodeDecodeError, ValueError):
                raise RelayProtocolError("bundle path is not a valid path") from None
            return lifecycle.prepare(
                container_id, bundle, hooks=not flags, spec_fd=fds[0] if spec_fd else None
            ).summary()
        case ["hook", stage, instance_id]:
            return lifecycle.hook(stage, instance_id, body, decided)
        # The shim's own bind (after create) and release (after delete): the
        # createRuntime and poststop hooks' work, with the same checks.
        case ["bind", instance_id]:
            return lifecycle.hook(BIND_STAGE, instance_id, body, decided, created=True)
        case ["release", instance_id]:
            return lifecycle.hook(RELEASE_STAGE, instance_id, body, decided)
        case _:
            raise RelayProtocolError(f"unknown request {' '.join(words)[:80]!r}")


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class RelayServer:
    """A unix-socket server; one short connection per request, handled on
    the accepting thread. A thread per request cost each round trip about
    0.18 ms more here (its creation and the hand-over to it), and every GPU
    container start waits on two; the requests would queue on the instance
    service's lock anyway."""

    def __init__(
        self,
        lifecycle: ContainerLifecycle,
        path: Path,
        on_request: Callable[[str, str], None] = lambda verb, code: None,
    ) -> None:
        self._lifecycle = lifecycle
        self._on_request = on_request  # (verb, "OK" or "error"), for metrics
        self._path = Path(os.path.abspath(path))
        self._log = structlog.get_logger("cgpud.relay")
        self._server: socketserver.UnixStreamServer | None = None
        self._after = threading.Event()  # set after each answer: work for the after thread
        self._after_thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> RelayServer:
        log = self._log
        prepare_socket_directory(self._path.parent, log)
        remove_stale_socket(self._path, log)
        answer = self._answer

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                answer(self.request)

        with owner_only_listening(self._path):  # the socket is 0600 from bind() on
            server = socketserver.UnixStreamServer(str(self._path), Handler)
        self._server = server
        self._after_thread = threading.Thread(target=self._work_after_answers, name="cgpud-relay-after", daemon=True)
        self._after_thread.start()
        threading.Thread(target=server.serve_forever, name="cgpud-relay", daemon=True).start()
        log.info("serving", socket=str(self._path))
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._path.unlink(missing_ok=True)
            self._server = None
        if self._after_thread is not None:  # its last work done before the daemon drops the spare
            self._stopping = True
            self._after.set()
            self._after_thread.join()
            self._after_thread = None

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT)
        answered = False
        fds: list[int] = []

        def reply(line: str) -> None:
            nonlocal answered
            if not answered:  # a bind or a release answers early, once (handle's `decided`)
                answered = True
                conn.sendall(answer_line(line))

        def early(text: str) -> None:
            try:
                reply(f"ok {text}")
            except OSError as e:  # the work goes on: the runtime's going away must not stop a release
                self._log.warning("relay connection failed", error=str(e))

        try:
            if _peer_uid(conn) not in (0, os.geteuid()):
                reply("error only root may use the cgpud relay socket")
                return
            words, body = _read_request(conn, fds)
            verb = f"{words[0]} {words[1]}" if words[:1] == ["hook"] and len(words) > 1 else words[0]
            verb = verb if verb in _VERBS else "other"
            try:
                text = handle(self._lifecycle, words, body, early, tuple(fds))
            except Exception:
                self._on_request(verb, "error")
                if answered:  # the runtime already has its ok: the work failed after it
                    self._log.exception("request failed after it was answered", verb=verb)
                    return
                raise
            self._on_request(verb, "OK")
            reply(f"ok {text}")
        except CgpuError as e:
            self._log.warning("refused", error=str(e))
            reply(f"error {e}")
        except OSError as e:  # the client went away or timed out: nobody to tell
            self._log.warning("relay connection failed", error=str(e))
        except Exception as e:  # never leave a runtime waiting on a silent daemon
            self._log.exception("relay request failed")
            try:
                reply(f"error cgpud failed on this request: {type(e).__name__}: {e}")
            except OSError:
                pass
        finally:
            for fd in fds:
                os.close(fd)
        self._after.set()

    def _work_after_answers(self) -> None:
        """What the runtime need not wait for (ContainerLifecycle.idle), on a
        thread of its own: the next request (another container's start, this
        one's bind) is read and answered meanwhile, and the work takes the
        instance lock only for moments (InstanceService.refill_region_spare).
        Answers that come while it runs fold into one more round of it."""
        while True:
            self._after.wait()
            if self._stopping:
                return
            self._after.clear()
            try:
                self._lifecycle.idle()
            except Exception:
                self._log.exception("work after the answer failed")
