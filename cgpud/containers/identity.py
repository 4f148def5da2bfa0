"""Which container a request is about: (engine namespace, container id).

A container id is unique only within one runtime state root: containerd
gives every namespace its own (`runc --root /run/containerd/runc/<ns>`), so
two namespaces may each run a container named `job`. The namespace here is
the container's canonical bundle directory, which the engine picks and the
tenant does not: containerd and dockerd use
`/run/containerd/io.containerd.runtime.v2.task/<namespace>/<id>`. The shim
(`prepare <id>` + bundle) and the hooks (OCI state: `id`, `bundle`) both
see it, so both derive the same key without anything new on the wire.

Pure apart from resolving the bundle path (as realpath does): runc reports the
bundle as its working directory, which may differ from the path the shim
was given by symbolic links."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cgpud.contract import CONTAINER_ID_MAX
from cgpud.errors import UsageError

# runc's own rule for container ids; '@' and '/' never occur in one.
CONTAINER_ID = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_.+-]{{0,{CONTAINER_ID_MAX - 1}}}$")
MAX_BUNDLE = 4096


@dataclass(frozen=True)
class ContainerKey:
    namespace: str  # the canonical bundle directory
    id: str

    def __str__(self) -> str:
        # Stored as an instance's owner id; unambiguous as ids hold no '@'.
        return f"{self.id}@{self.namespace}"


def container_key(container_id: str, bundle: str | Path) -> ContainerKey:
    if not isinstance(container_id, str) or not CONTAINER_ID.fullmatch(container_id):
        raise UsageError(f"container id {str(container_id)[:80]!r} is not a valid OCI container id")
    text = os.fspath(bundle) if isinstance(bundle, (str, Path)) else None
    if not text or not text.startswith("/") or len(text) > MAX_BUNDLE or "\0" in text:
        raise UsageError(f"container {container_id}: bundle path {str(bundle)[:80]!r} is not an absolute path")
    try:
        text.encode()  # it becomes the instance's owner, a TEXT column
    except UnicodeEncodeError:
        raise UsageError(f"container {container_id}: bundle path {text[:80]!r} is not valid UTF-8") from None
    return ContainerKey(_canonical(text), container_id)


def _canonical(path: str) -> str:
    """realpath(path): the kernel's name for the open path (three calls on
    the start path, where os.path.realpath makes one per component); that
    of os.path.realpath when it cannot be opened or has been removed."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return os.path.realpath(path)
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)
    finally:
        os.close(fd)
    return name if name.startswith("/") and not name.endswith(" (deleted)") else os.path.realpath(path)
