"""What giving a container its instance changes in its OCI spec: env for
applications, mounts for libcgpu.so and the region, hooks that bind and
release. Pure: the same edits feed the bundle rewrite (runtime shim) and the
CDI spec, so both paths give a container exactly the same view.

Every mount source is a file cgpud made in its own root-owned directories;
no path of the container is ever a source. Targets are left to the runtime,
which resolves them inside the rootfs without leaving it (runc's securejoin)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpud.containers.devices import DeviceNode
from cgpud.contract import RELAY_WAIT_S
from cgpud.node.model import GIB, Instance
from cgpud.errors import UsageError
from cgpud.containers.request import CONTAINER_REGION, ENV_CORE, ENV_MEMORY, ENV_MEMORY_DEV, ENV_MEMORY_INDEX
from cgpud.containers.request import ENV_MEMORY_POD
from cgpud.node.mps import CONTAINER_PIPE, client_env, mps_pipe
from cgpud.node.region import USAGE_FILE

CONTAINER_LIBRARY = "/usr/local/cgpu/libcgpu.so"
PRELOAD = "/etc/ld.so.preload"
# Seconds runc gives the hook: a bind is one SQLite commit, but the hook may
# first wait RELAY_WAIT_S for a restarting cgpud, and its own message must
# come before runc's kill.
HOOK_TIMEOUT = RELAY_WAIT_S + 20
HOOK_ENV = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)  # explicit: never the image's env
BIND_STAGE = "createRuntime"
RELEASE_STAGE = "poststop"
HOOK_NAME = "cgpu-hook"  # argv[0] of cgpud's hook entries, whichever version's copy they run
ANNOTATION = "cgpu.io/instance"  # informative only; never read back as input

# Set for applications; replaced wherever the spec already had them.
APP_ENV = (
    ENV_MEMORY,
    ENV_MEMORY_DEV,
    ENV_MEMORY_INDEX,
    ENV_MEMORY_POD,
    "NVIDIA_VISIBLE_DEVICES",
    ENV_CORE,
)


@dataclass(frozen=True)
class RuntimeFiles:
    """Host files cgpud installs for containers (see runtime_files.py)."""

    library: Path  # libcgpu.so
    preload: Path  # an ld.so.preload naming CONTAINER_LIBRARY
    hook: Path  # cgpu-hook
    relay_socket: Path
    version: str = ""  # the runtime directory's name (runtime_files.py); "" for the unversioned files


@dataclass(frozen=True)
class Mount:
    source: str
    destination: str
    read_only: bool
    exec_ok: bool = False

    @property
    def options(self) -> list[str]:
        opts = ["rbind", "ro" if self.read_only else "rw", "nosuid", "nodev"]
        return opts if self.exec_ok else [*opts, "noexec"]


@dataclass(frozen=True)
class Hook:
    stage: str
    path: str
    args: tuple[str, ...]
    env: tuple[str, ...] = HOOK_ENV
    timeout: int = HOOK_TIMEOUT


@dataclass(frozen=True)
class ContainerEdits:
    env: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...]
    hooks: tuple[Hook, ...]
    instance_id: str
    # The GPUs' device nodes, for CDI only: on the shim's path the NVIDIA
    # toolkit makes them from NVIDIA_VISIBLE_DEVICES, and two makers of one
    # node would fail the start.
    device_nodes: tuple[DeviceNode, ...] = ()


def application_env(instance: Instance, gpu_memory: Mapping[int, int]) -> dict[str, str]:
    """The variables cGPU applications read: outputs for them, never inputs
    to enforcement. DEV is rounded down to whole GiB, as ACK shows it."""
    grants = instance.grants
    mem = str(sum(g.memory for g in grants) // GIB)
    env = {
        ENV_MEMORY: mem,
        ENV_MEMORY_DEV: str(gpu_memory[grants[0].gpu_index] // GIB),
        ENV_MEMORY_INDEX: ",".join(str(g.gpu_index) for g in grants),
        ENV_MEMORY_POD: mem,
        "NVIDIA_VISIBLE_DEVICES": ",".join(g.gpu_uuid for g in grants),
    }
    if grants[0].core_percent:
        env[ENV_CORE] = str(grants[0].core_percent)
    return env


def instance_edits(
    instance: Instance,
    region: Path,
    gpu_memory: Mapping[int, int],
    files: RuntimeFiles,
    *,
    hooks: bool = True,
    device_nodes: tuple[DeviceNode, ...] = (),
    mps_pipes: Mapping[int, Path] | None = None,
) -> ContainerEdits:
    """Env and the bind hook for every instance; the library, its preload
    entry and the region only where the node enforces limits (not in share
    mode). hooks=False: the runtime shim binds after `create` itself, so runc
    runs no hook of ours. No poststop hook: cgpud learns of the init's exit
    itself (node/exits.py); apply_edits still drops one an older version
    wrote. `mps_pipes` (GPU index -> pipe directory, on an mps node): the
    GPU's MPS pipe directory, read-only, and the MPS variables for it."""
    mounts: tuple[Mount, ...] = ()
    env = application_env(instance, gpu_memory)
    if instance.enforced:
        mounts = (
            Mount(str(region), CONTAINER_REGION, read_only=True),
            Mount(str(region / USAGE_FILE), f"{CONTAINER_REGION}/{USAGE_FILE}", read_only=False),
            Mount(str(files.library), CONTAINER_LIBRARY, read_only=True, exec_ok=True),
            Mount(str(files.preload), PRELOAD, read_only=True),
        )
        pipe = mps_pipe(instance, mps_pipes or {})
        if pipe is not None:
            grant = instance.grants[0]
            mounts += (Mount(str(pipe), CONTAINER_PIPE, read_only=True),)
            env.update(client_env(grant.core_percent, grant.memory))
    entries = (
        tuple(
            Hook(
                stage,
                str(files.hook),
                (HOOK_NAME, "--socket", str(files.relay_socket), "--instance", instance.id, stage),
            )
            for stage in (BIND_STAGE,)
        )
        if hooks
        else ()
    )
    return ContainerEdits(tuple(env.items()), mounts, entries, instance.id, device_nodes)


def _ours(mount: Any, destinations: set[str]) -> bool:
    # Normalised as request.claim() reads it: /run//cgpu is /run/cgpu.
    return isinstance(mount, Mapping) and os.path.normpath(str(mount.get("destination", ""))) in destinations


def apply_edits(
    spec: Mapping[str, Any], edits: ContainerEdits, files: RuntimeFiles, *, copy: bool = True
) -> dict[str, Any]:
    """A new spec with the edits in. Idempotent: earlier cgpu edits (a
    retried create on the same bundle) are replaced, not repeated. Our
    mounts go last so they cover anything the image or user mounted there.
    copy=False edits `spec` itself, for a caller that owns it (the start
    path, which has just parsed it)."""
    # A deep copy: JSON in, JSON out, and faster than copy.deepcopy.
    out = spec if not copy and isinstance(spec, dict) else json.loads(json.dumps(spec))
    process = _member(out, "process", dict, "process")
    names = {k for k, _ in edits.env} | set(APP_ENV)
    env_in = _member(process, "env", list, "process.env")
    if not all(isinstance(e, str) for e in env_in):
        raise UsageError("config.json: process.env must be a list of NAME=VALUE strings")
    env = [e for e in env_in if e.split("=", 1)[0] not in names]
    process["env"] = env + [f"{k}={v}" for k, v in edits.env]

    ours = {m.destination for m in edits.mounts} | {
        CONTAINER_REGION,
        f"{CONTAINER_REGION}/usage",
        CONTAINER_LIBRARY,
        PRELOAD,
    }
    mounts = [m for m in _member(out, "mounts", list, "mounts") if not _ours(m, ours)]
    mounts += [
        {"destination": m.destination, "type": "bind", "source": m.source, "options": m.options} for m in edits.mounts
    ]
    out["mounts"] = mounts

    # Our stages are always swept, so a retried create that the shim now
    # binds itself drops the entries an earlier prepare wrote.
    stages = {BIND_STAGE, RELEASE_STAGE} | {h.stage for h in edits.hooks}
    if edits.hooks or (isinstance(out.get("hooks"), Mapping) and stages & set(out["hooks"])):
        hooks = _member(out, "hooks", dict, "hooks")
        for stage in sorted(stages):
            if hooks.get(stage) is None and not any(h.stage == stage for h in edits.hooks):
                continue
            stage_hooks = _member(hooks, stage, list, f"hooks.{stage}")
            # Ours by path, or by name: an edit by another cgpud version names
            # that version's copy of the hook.
            kept = [
                h
                for h in stage_hooks
                if not (isinstance(h, Mapping) and (h.get("path") == str(files.hook) or _hook_name(h) == HOOK_NAME))
            ]
            kept += [
                {"path": h.path, "args": list(h.args), "env": list(h.env), "timeout": h.timeout}
                for h in edits.hooks
                if h.stage == stage
            ]
            if kept:
                hooks[stage] = kept
            else:
                del hooks[stage]
    _member(out, "annotations", dict, "annotations")[ANNOTATION] = edits.instance_id
    return out


def _hook_name(hook: Mapping[str, Any]) -> object:
    args = hook.get("args")
    return args[0] if isinstance(args, list) and args else None


def _member(obj: dict[str, Any], key: str, kind: type, what: str) -> Any:
    """obj[key], made empty when absent or null. Another shape is refused,
    not half-edited: a spec that claims an instance reaches here with
    nothing but its mounts read."""
    if obj.get(key) is None:
        obj[key] = kind()
    if not isinstance(obj[key], kind):
        raise UsageError(f"config.json: {what} must be {'an object' if kind is dict else 'a list'}")
    return obj[key]
