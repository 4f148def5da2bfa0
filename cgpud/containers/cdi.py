"""CDI (Container Device Interface) spec for device-owned instances: each
one a device `cgpu.io/gpu=<instance id>` whose containerEdits are the edits
the runtime shim writes into a bundle (edits.py), so a container gets the
same view whichever path started it, and the device nodes of the instance's
GPUs, which on the shim's path the NVIDIA toolkit makes (devices.py). The region mount in those edits is
also the container's claim on the instance (request.py), and the hook binds
it at createRuntime; cgpud hands it back when the container's init exits
(lifecycle.py, node/exits.py).

Only fields the CDI spec defines are written: runtimes refuse a spec with an
unknown field. Field names follow the CDI spec (SPEC.md, specs-go/config.go
and schema/defs.json of cncf-tags/container-device-interface).

Runtimes read specs from /etc/cdi (static) and /var/run/cdi (dynamic)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgpud.atomicfile import write_atomic
from cgpud.containers.devices import HOST_ROOT, DeviceNode, device_paths, present
from cgpud.node.model import GpuCapacity, OwnerKind
from cgpud.errors import CgpuError, StateError, UsageError
from cgpud.containers.edits import ContainerEdits, Mount, RuntimeFiles, instance_edits

if TYPE_CHECKING:  # cgpuctl imports this module for write_spec; it needs no service
    from cgpud.node.service import InstanceService

# Loaders refuse a spec whose declared version is below what its fields
# need (specs-go/version.go); ours need 0.4.0, for the mounts' `type`.
CDI_VERSION = "0.6.0"
KIND = "cgpu.io/gpu"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
NO_DEVICES = "no device instances to describe: reserve one with `cgpuctl create --mem SIZE` first"


def _mount(m: Mount) -> dict[str, Any]:
    return {"hostPath": m.source, "containerPath": m.destination, "type": "bind", "options": m.options}


def _device_node(d: DeviceNode) -> dict[str, Any]:
    node: dict[str, Any] = {"path": d.path, "type": "c", "major": d.major, "minor": d.minor, "permissions": "rw"}
    if d.host_path:  # CDI 0.5.0's hostPath: the node is elsewhere on the host (a dev_root)
        node["hostPath"] = d.host_path
    return node


def device(edits: ContainerEdits) -> dict[str, Any]:
    """One CDI device. Empty lists are left out: the CDI types mark them
    omitempty, and a reader never has to tell [] from absent."""
    container_edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in edits.env]}
    if edits.mounts:
        container_edits["mounts"] = [_mount(m) for m in edits.mounts]
    if edits.device_nodes:
        container_edits["deviceNodes"] = [_device_node(d) for d in edits.device_nodes]
    if edits.hooks:
        container_edits["hooks"] = [
            {"hookName": h.stage, "path": h.path, "args": list(h.args), "env": list(h.env), "timeout": h.timeout}
            for h in edits.hooks
        ]
    return {"name": edits.instance_id, "containerEdits": container_edits}


def cdi_spec(devices: Sequence[ContainerEdits]) -> dict[str, Any]:
    """The CDI spec for these instances, in the order given. Raises
    StateError for none: a spec without devices is invalid ("invalid spec,
    no devices"), so runtimes would refuse the file, and with it the kind."""
    if not devices:
        raise StateError(NO_DEVICES)
    return {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": [device(e) for e in devices]}


def device_instance_edits(
    service: InstanceService, files: RuntimeFiles, dev_root: Path = HOST_ROOT
) -> list[ContainerEdits]:
    """The edits of every active device-owned instance, oldest first. Each
    instance is recorded as using these runtime files first (runtime_files.py)."""
    gpu_memory = {g.index: g.memory for g in service.gpus()}
    devices = [i for i in service.list() if i.owner.kind is OwnerKind.DEVICE]
    service.use_runtime([i.id for i in devices], files.version)
    return [
        instance_edits(
            i,
            service.region_dir(i.id),
            gpu_memory,
            files,
            device_nodes=instance_device_nodes(service.gpus(), [g.gpu_index for g in i.grants], dev_root),
            mps_pipes=service.mps_pipes(),
        )
        for i in devices
    ]


def instance_device_nodes(
    gpus: Sequence[GpuCapacity], indexes: Sequence[int], dev_root: Path = HOST_ROOT
) -> tuple[DeviceNode, ...]:
    """The device nodes of these GPUs (and the control nodes) the host has."""
    by_index = {g.index: (g.device_node, *g.extra_nodes) for g in gpus}
    return present(device_paths([p for i in indexes for p in by_index.get(i, ())]), dev_root)


def render(service: InstanceService, files: RuntimeFiles, dev_root: Path = HOST_ROOT) -> str:
    """The daemon's current CDI spec as JSON text (GetCdiSpec)."""
    return json.dumps(cdi_spec(device_instance_edits(service, files, dev_root)), indent=2) + "\n"


def check_output(path: Path) -> Path:
    """Where `cgpuctl cdi generate --output` may write, checked before the
    daemon is asked so a typo costs nothing."""
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(
            f"cannot write {path}: directory {parent} does not exist "
            f"(runtimes read {' and '.join(SPEC_DIRS)}; create it first)"
        )
    if path.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory; give a file name such as {path / 'cgpu.json'}")
    return path


def write_spec(text: str, path: Path) -> None:
    """Write atomically: runtimes may load the directory at any moment and
    must see the old spec or the new one, never half of one. The temporary
    name ends in .tmp, which runtimes skip (they read *.json and *.yaml)."""
    try:
        write_atomic(path, text.encode(), 0o644, suffix=".tmp")
    except OSError as e:
        raise CgpuError(f"cannot write {path}: {e.strerror or e}") from e
