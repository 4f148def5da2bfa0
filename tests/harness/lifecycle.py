"""The container start path's core over a real instance service (SQLite,
region files) in a temp dir, and the OCI bundle and state documents the
relays hand it."""

from __future__ import annotations

import json
from pathlib import Path

from cgpud.containers.edits import RuntimeFiles
from cgpud.containers.lifecycle import ContainerLifecycle
from cgpud.node.model import GIB, GpuCapacity, NodePolicy
from cgpud.node.service import InstanceService
from cgpud.node.store import Store

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB),)
# Where a default install keeps instance regions and the runtime files: what
# the container edits name when a test only reads them and runs nothing.
INSTALLED_REGIONS = Path("/var/lib/cgpud/instances")
INSTALLED_FILES = RuntimeFiles(
    Path("/var/lib/cgpud/runtime/libcgpu.so"),
    Path("/var/lib/cgpud/runtime/ld.so.preload"),
    Path("/var/lib/cgpud/runtime/cgpu-hook"),
    Path("/run/cgpud/relay.sock"),
)


def lifecycle(tmp_path: Path) -> tuple[ContainerLifecycle, InstanceService]:
    svc = InstanceService(Store(tmp_path / "db" / "cgpud.db"), GPUS, NodePolicy(), tmp_path / "regions", "580", "b")
    rt = tmp_path / "rt"
    files = RuntimeFiles(rt / "libcgpu.so", rt / "ld.so.preload", rt / "cgpu-hook", tmp_path / "relay.sock")
    return ContainerLifecycle(svc, files, trust_env=True), svc


def bundle(where: Path, *env: str, mounts: list[dict] | None = None) -> Path:
    (where / "rootfs").mkdir(parents=True)
    spec = {
        "ociVersion": "1.0.2",
        "root": {"path": "rootfs"},
        "mounts": mounts or [],
        "process": {"args": ["sh"], "env": ["PATH=/bin", *env]},
    }
    (where / "config.json").write_text(json.dumps(spec))
    return where


def state(cid: str, bundle_dir: Path, pid: int | None = None) -> bytes:
    s: dict = {"ociVersion": "1.0.2", "id": cid, "status": "creating", "bundle": str(bundle_dir)}
    if pid:
        s["pid"] = pid
    return json.dumps(s).encode()
