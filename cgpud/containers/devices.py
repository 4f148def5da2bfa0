"""The driver's device nodes a container needs for its GPUs: the control
nodes (/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools) and one
/dev/nvidia<minor> per GPU. cgpud's CDI spec and its whole-GPU Allocate
answers carry them, so a pod gets exactly its GPUs' nodes without the
NVIDIA toolkit's environment-variable path (docs/containers.md, "A GPU only
through an instance"). Nodes the host does not have are left out: a runtime
refuses a spec naming a missing node."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


@dataclass(frozen=True)
class DeviceNode:
    path: str  # the same on the host and in the container
    major: int
    minor: int


def gpu_node(minor_number: int) -> str:
    return f"/dev/nvidia{minor_number}"


def device_paths(gpu_nodes: Sequence[str]) -> tuple[str, ...]:
    """The control nodes, then each GPU's node, in order, once each."""
    return tuple(dict.fromkeys((*CONTROL_NODES, *(p for p in gpu_nodes if p))))


def present(paths: Iterable[str], stat_path: Callable[[str], os.stat_result] = os.stat) -> tuple[DeviceNode, ...]:
    """The character devices among `paths` as the host has them now."""
    nodes = []
    for path in paths:
        try:
            st = stat_path(path)  # follows links: a driver may link a node
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            nodes.append(DeviceNode(path, os.major(st.st_rdev), os.minor(st.st_rdev)))
    return tuple(nodes)
