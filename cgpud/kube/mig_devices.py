"""The device nodes a container needs for a MIG device beyond its GPU's:
the driver's capability nodes of its GPU instance and compute instance,
`/dev/nvidia-caps/nvidia-cap<minor>`, whose minors the driver lists in
/proc/driver/nvidia-caps/mig-minors as `gpu<G>/gi<I>/access <minor>` and
`gpu<G>/gi<I>/ci<C>/access <minor>` (G the GPU's device minor). A host
without the file (a driver that makes no capability nodes) or without a node gives none: a
runtime refuses a spec naming a missing node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import os

from cgpud.boundedread import read_at_most
from cgpud.containers.devices import HOST_ROOT, DeviceNode, present
from cgpud.node.inventory import Gpu, MigDevice

MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
_MAX_MINORS_FILE = 1 << 20


def parse_mig_minors(text: str) -> dict[str, int]:
    """ "gpu0/gi1/ci0/access" -> minor; lines that do not read so are skipped."""
    minors = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("gpu") and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    return minors


def capability_paths(
    devices: Sequence[MigDevice], gpu_minors: Mapping[int, int], minors: Mapping[str, int]
) -> list[str]:
    """The capability node paths of each device's GPU and compute instance."""
    paths = []
    for m in devices:
        gpu = gpu_minors.get(m.parent_index)
        if gpu is None:
            continue
        gi = f"gpu{gpu}/gi{m.gpu_instance}"
        for key in (f"{gi}/access", f"{gi}/ci{m.compute_instance}/access"):
            if key in minors:
                paths.append(f"/dev/nvidia-caps/nvidia-cap{minors[key]}")
    return list(dict.fromkeys(paths))


def _read_minors(source: Path) -> dict[str, int]:
    try:
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return {}  # no MIG capability nodes on this host
    try:
        return parse_mig_minors(read_at_most(fd, _MAX_MINORS_FILE).decode(errors="replace"))
    finally:
        os.close(fd)


def capability_map(gpus: Sequence[Gpu], source: Path = MIG_MINORS) -> dict[str, tuple[str, ...]]:
    """Each MIG device's capability node paths, by MIG UUID (setting
    mig_share: they go with its instances' device nodes)."""
    minors = _read_minors(source)
    by_gpu = {g.index: g.minor_number for g in gpus}
    return {m.uuid: tuple(capability_paths([m], by_gpu, minors)) for g in gpus for m in g.mig_devices}


def capability_nodes(
    devices: Sequence[MigDevice], gpu_minors: Mapping[int, int], dev_root: Path = HOST_ROOT, source: Path = MIG_MINORS
) -> tuple[DeviceNode, ...]:
    minors = _read_minors(source)
    return present(capability_paths(devices, gpu_minors, minors), dev_root) if minors else ()
