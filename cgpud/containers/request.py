"""What a container asks for, read from its OCI spec (config.json).

Pure: a parsed spec in, a decision out. Two channels carry a request:

- env in the spec (`ALIYUN_COM_GPU_MEM_CONTAINER=<GiB>` and friends), as
  standalone cGPU users write `docker run -e ...`. Anyone who writes the spec
  writes these, so they count only where the node trusts env requests
  (standalone hosts, where the spec's author is the host's operator).
- a claim: a mount of an instance directory the daemon made
  (`<regions>/<id>` at /run/cgpu). Only the daemon's own channels put it there
  (the device plugin's Allocate answer, a CDI device): a pod spec cannot name
  a host path, so in Kubernetes mode this is the only channel trusted.

Errors are UsageError with one line naming the variable and what to write."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpud.contract import CONTAINER_REGION, ENV_PREFIX, INSTANCE_ID_MAX
from cgpud.errors import UsageError

# The runtime shim sends a bundle to cgpud only if its config holds
# ENV_PREFIX (or a claim): every name a request is read from starts so.
ENV_MEMORY = f"{ENV_PREFIX}_MEM_CONTAINER"  # GiB per GPU
# Outputs for applications only (ACK sets them too); never read as a request.
ENV_MEMORY_DEV = f"{ENV_PREFIX}_MEM_DEV"  # GiB of the physical GPU
ENV_MEMORY_INDEX = f"{ENV_PREFIX}_MEM_IDX"
ENV_MEMORY_POD = f"{ENV_PREFIX}_MEM_POD"
ENV_CORE = f"{ENV_PREFIX}_CORE_PERCENTAGE"  # aliyun.com/gpu-core.percentage
ENV_COUNT = f"{ENV_PREFIX}_COUNT"  # aliyun.com/gpu-count
ENV_WEIGHT = f"{ENV_PREFIX}_SCHD_WEIGHT"
ENV_PRIORITY = f"{ENV_PREFIX}_HIGH_PRIO"
ENV_VISIBLE = f"{ENV_PREFIX}_VISIBLE_DEVICES"
ENV_DISABLE = "CGPU_DISABLE"  # only ever turns a request off
REQUEST_ENV = (ENV_MEMORY, ENV_CORE, ENV_COUNT, ENV_WEIGHT, ENV_PRIORITY)

_INSTANCE_ID = re.compile(rf"^[A-Za-z0-9_.-]{{1,{INSTANCE_ID_MAX}}}$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class EnvRequest:
    """A request written as env in the spec."""

    memory_gib: int
    gpu_count: int = 1
    core_percent: int = 0
    weight: int = 1
    priority: int = 0


@dataclass(frozen=True)
class Claim:
    """The spec mounts an instance the daemon already reserved."""

    instance_id: str


def spec_env(spec: Mapping[str, Any]) -> dict[str, str]:
    """process.env as a dict. A name set twice with different values is
    refused: glibc's getenv reads the first, other readers the last."""
    process = spec.get("process")
    raw = process.get("env", []) if isinstance(process, Mapping) else []
    if not isinstance(raw, list):
        raise UsageError("config.json: process.env must be a list of NAME=VALUE strings")
    env: dict[str, str] = {}
    for item in raw:
        if not isinstance(item, str):
            raise UsageError("config.json: process.env must be a list of NAME=VALUE strings")
        name, _, value = item.partition("=")
        if name in env and env[name] != value and name in (*REQUEST_ENV, ENV_DISABLE, ENV_VISIBLE):
            raise UsageError(f"{name} is set twice ({env[name]!r} and {value!r}): set it once")
        env.setdefault(name, value)
    return env


def parse_whole(env: Mapping[str, str], name: str, default: int, low: int, high: int, unit: str, example: str) -> int:
    """env[name] as a whole number in [low, high]; `default` when unset."""
    text = env.get(name)
    if text is None:
        return default
    if not re.fullmatch(r"\s*\d+\s*", text):
        raise UsageError(f"{name}={text!r} is not a whole number{unit}: set it to e.g. {example}")
    value = int(text)
    if not low <= value <= high:
        raise UsageError(f"{name}={value} is out of range: use {low} to {high}{unit}")
    return value


def parse_flag(env: Mapping[str, str], name: str) -> bool:
    """env[name] as yes or no (unset or empty: no)."""
    text = env.get(name, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise UsageError(f"{name}={env[name]!r} is not a yes/no value: use 1 or 0 (true or false)")


def env_request(env: Mapping[str, str]) -> EnvRequest | None:
    """The request the env makes, None when it makes none. Ranges here are
    only what a number can mean at all; whether the node can grant it is
    placement's decision."""
    if not any(name in env for name in REQUEST_ENV):
        return None
    if parse_flag(env, ENV_DISABLE):
        return None
    if ENV_VISIBLE in env:
        raise UsageError(
            f"{ENV_VISIBLE} is not supported: cgpud places the container on a GPU by the node's placement "
            f"policy; remove it and ask only for memory ({ENV_MEMORY}) and GPU count ({ENV_COUNT})"
        )
    if ENV_MEMORY not in env:
        present = next(name for name in REQUEST_ENV if name in env)
        raise UsageError(f"{present} is set but {ENV_MEMORY} is not: ask for GPU memory in GiB, e.g. {ENV_MEMORY}=2")
    return EnvRequest(
        memory_gib=parse_whole(env, ENV_MEMORY, 0, 1, 1 << 20, " of GiB", "2"),
        gpu_count=parse_whole(env, ENV_COUNT, 1, 1, 64, " of GPUs", "1"),
        core_percent=parse_whole(env, ENV_CORE, 0, 0, 100, " percent", "30"),
        weight=parse_whole(env, ENV_WEIGHT, 1, 1, 100, "", "2"),
        priority=1 if ENV_PRIORITY in env and parse_flag(env, ENV_PRIORITY) else 0,
    )


def _within(path: str, directory: Path) -> str | None:
    """The first component of `path` under `directory`, compared lexically
    after normalising: the source is a host path the daemon never opens."""
    norm = os.path.normpath(path)
    root = str(directory)
    if not norm.startswith(root + os.sep):
        return None
    return norm[len(root) + 1 :].split(os.sep)[0]


def claim(mounts: Sequence[Any], regions: Path) -> Claim | None:
    """The instance a spec's /run/cgpu mount names. Anything else mounted at
    or under /run/cgpu is refused: the place belongs to the daemon."""
    found: str | None = None
    for m in mounts:
        if not isinstance(m, Mapping):
            raise UsageError("config.json: every entry of mounts must be an object")
        dest = os.path.normpath(str(m.get("destination", "")))
        if dest != CONTAINER_REGION and not dest.startswith(CONTAINER_REGION + "/"):
            continue
        instance = _within(str(m.get("source", "")), regions)
        if instance is None or not _INSTANCE_ID.fullmatch(instance):
            raise UsageError(
                f"a mount at {dest} from {m.get('source')!r} is not a cgpu instance: "
                f"{CONTAINER_REGION} is reserved for cgpu; mount elsewhere"
            )
        if found is not None and found != instance:
            raise UsageError(f"the spec mounts two cgpu instances ({found} and {instance}): a container uses one")
        found = instance
    return Claim(found) if found else None


# What the NVIDIA container toolkit gives a container GPUs by (its
# accept-nvidia-visible-devices-envvar-when-unprivileged, on by default), and
# the value for which it gives none and mounts nothing.
TOOLKIT_ENV = "NVIDIA_VISIBLE_DEVICES"
TOOLKIT_NONE = "void"


def without_toolkit_devices(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """For a container with no instance on an isolating node: the spec with
    every NVIDIA_VISIBLE_DEVICES (the image's, the engine's, `docker run
    --gpus`'s) set to "void", so the toolkit gives it no GPU; None when it
    names none already. Anything a container can write gets a GPU only
    through an instance."""
    process = spec.get("process")
    if not isinstance(process, Mapping):
        return None
    raw = process.get("env")
    if not isinstance(raw, list):
        return None
    prefix = TOOLKIT_ENV + "="
    if all(not (isinstance(e, str) and e.startswith(prefix)) or e == prefix + TOOLKIT_NONE for e in raw):
        return None
    env = [prefix + TOOLKIT_NONE if isinstance(e, str) and e.startswith(prefix) else e for e in raw]
    return {**spec, "process": {**process, "env": env}}


def read_request(spec: Mapping[str, Any], *, trust_env: bool, regions: Path) -> EnvRequest | Claim | None:
    """What the spec asks for. A claim wins over env (the env then only
    repeats what the channel that made the claim wrote); untrusted env is
    not read at all, so in Kubernetes mode it cannot even produce an error."""
    mounts = spec.get("mounts", [])
    if not isinstance(mounts, list):
        raise UsageError("config.json: mounts must be a list")
    found = claim(mounts, regions)
    if found is not None:
        return found
    return env_request(spec_env(spec)) if trust_env else None
