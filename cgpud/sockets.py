"""Unix sockets cgpud serves on (the gRPC API, the relay socket): a
root-owned directory others cannot write, and a stale socket removed only
when nothing answers on it."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cgpud.errors import CgpuError


def prepare_socket_directory(directory: Path, log: Any) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # mkdir's mode passes through the umask
        return
    except FileExistsError:
        pass
    st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise CgpuError(f"cannot serve in {directory}: not a directory")
    if st.st_mode & 0o022:
        # Anyone who can write there can replace our socket with theirs and
        # answer cgpuctl (run as root) in our name.
        raise CgpuError(
            f"cannot serve in {directory}: it is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); use a root-owned 0700 directory such as /run/cgpud"
        )
    if st.st_mode & 0o077:
        log.warning(
            "socket directory is open to other users: between bind and chmod the socket is reachable;"
            " make it 0700 (RuntimeDirectoryMode=0700)",
            directory=str(directory),
            mode=f"{stat.S_IMODE(st.st_mode):04o}",
        )


@contextmanager
def owner_only_listening(path: Path) -> Iterator[None]:
    """A socket bound to `path` inside is 0600 from bind() on (umask 0177):
    no moment when others may connect. An OSError inside becomes the
    CgpuError that names `path`."""
    old = os.umask(0o177)
    try:
        yield
    except OSError as e:
        raise CgpuError(f"cannot listen on {path}: {e.strerror}") from e
    finally:
        os.umask(old)


def remove_stale_socket(path: Path, log: Any) -> None:
    """Remove the socket a killed daemon left behind, but never one that a
    live server still answers on (gRPC itself would silently unlink it and
    steal the path) and never a file that is not a socket."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise CgpuError(f"cannot listen on {path}: a file that is not a socket is in the way; remove it if stale")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)  # a full backlog makes connect() wait; that server is alive
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
            log.info("removed stale socket", socket=str(path))
            return
        except (TimeoutError, BlockingIOError):
            pass
        except OSError as e:
            raise CgpuError(f"cannot check the existing socket {path}: {e}") from e
    raise CgpuError(f"another process already serves on {path}: is cgpud running? (systemctl status cgpud)")
