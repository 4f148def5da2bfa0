"""The driver's device nodes a container needs for its GPUs: the control
nodes (/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools) and one
/dev/nvidia<minor> per GPU. cgpud's CDI spec and its whole-GPU Allocate
answers carry them, so a pod gets exactly its GPUs' nodes without the
NVIDIA toolkit's environment-variable path (docs/containers.md, "A GPU only
through an instance"). Nodes the host does not have are left out: a runtime
refuses a spec naming a missing node.

A driver installed in a container (the GPU Operator's, under
/run/nvidia/driver) makes its nodes under its own root: `dev_root` is that
root, as the NVIDIA toolkit's dev-root is; containers still see /dev/nvidia*."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


HOST_ROOT = Path("/")


@dataclass(frozen=True)
class DeviceNode:
    path: str  # in the container
    major: int
    minor: int
    host_path: str = ""  # on the host, where not `path` (a dev_root other than /)

    @property
    def on_host(self) -> str:
        return self.host_path or self.path


def gpu_node(minor_number: int) -> str:
    return f"/dev/nvidia{minor_number}"


def device_paths(gpu_nodes: Sequence[str]) -> tuple[str, ...]:
    """The control nodes, then each GPU's node, in order, once each."""
    return tuple(dict.fromkeys((*CONTROL_NODES, *(p for p in gpu_nodes if p))))


def present(
    paths: Iterable[str], dev_root: Path = HOST_ROOT, stat_path: Callable[[str], os.stat_result] = os.stat
) -> tuple[DeviceNode, ...]:
    """The character devices among `paths` (/dev/...) as the host has them
    now under `dev_root`."""
    nodes = []
    for path in paths:
        on_host = str(dev_root / path.lstrip("/"))
        try:
            st = stat_path(on_host)  # follows links: a driver may link a node
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            host_path = "" if on_host == path else on_host
            nodes.append(DeviceNode(path, os.major(st.st_rdev), os.minor(st.st_rdev), host_path))
    return tuple(nodes)
