"""atheris target: a bundle's config.json through everything cgpud does with
it at `prepare` (cgpud/containers/bundle.py, request.py, edits.py): read the spec,
read its GPU request, check the mount targets in a real rootfs and the
spec's own volumes, apply the edits, write the spec back.

Input: [flags][config.json bytes]; flags bit 0: the node trusts env requests,
bit 1: the instance is enforced (cgpu mode) rather than share mode, bit 2:
the rest is not the file but drives a generator of JSON specs (spec_from),
which reaches odd shapes (a string where an object belongs) that byte
mutations of JSON text rarely make. "REGIONS/" in the file stands for the
daemon's instance directory. The bundle holds three rootfs trees the spec
can name: rootfs (plain), linked (links where cgpu mounts) and filed (a file
where a directory must be).

What must hold for any input:
- a refusal is a UsageError (one clear line), nothing else escapes;
- the runtime shim's raw-byte scan (csrc/hook/cgpu_runtime.c, mirrored in
  shim_may_ask) sends every config with a request to cgpud: a config it
  passes over would start without its limits;
- the edited spec reads back as written, asks for exactly its instance,
  and editing it again changes nothing."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["cgpud.containers"]):
    from cgpud.containers.bundle import check_targets, check_volumes, read_spec, rootfs_path, write_spec
    from cgpud.containers.edits import RuntimeFiles, apply_edits, instance_edits
    from cgpud.containers.request import Claim, read_request

from cgpud.contract import ENV_PREFIX
from cgpud.node.model import GIB, Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.errors import CgpuError

# The shim's markers (runtime_rules.h MARKERS: the env prefix, "/cgpu", an
# escaped slash, the toolkit's variable) and its \uXXXX rule.
SHIM_MARKERS = (ENV_PREFIX.encode(), b"/cgpu", b"\\/", b"NVIDIA_VISIBLE_DEVICES")
_NAME_ESCAPE = re.compile(rb"\\u([0-9a-fA-F]{4})")
GPU_MEMORY = {0: 16 * GIB, 1: 16 * GIB}
KEYS = (
    "ociVersion",
    "process",
    "env",
    "args",
    "root",
    "path",
    "mounts",
    "destination",
    "source",
    "type",
    "options",
    "hooks",
    "createRuntime",
    "poststop",
    "prestart",
    "annotations",
    "timeout",
    "cgpu.io/instance",
)
WORDS = (
    "/run/cgpu",
    "/run/cgpu/usage",
    "/run/cgpu/",
    "/run",
    "/etc",
    "/usr/local",
    "/usr/local/cgpu/libcgpu.so",
    "/etc/ld.so.preload",
    "rootfs",
    "linked",
    "filed",
    "bind",
    "rbind",
    "ro",
    "tmpfs",
    "overlay",
    "/tmp",
    "REGIONS/cgpu-0000aaaa",
    "REGIONS/cgpu-0000aaaa/usage",
    "ALIYUN_COM_GPU_MEM_CONTAINER=2",
    "ALIYUN_COM_GPU_CORE_PERCENTAGE=30",
    "ALIYUN_COM_GPU_COUNT=2",
    "CGPU_DISABLE=0",
    "PATH=/bin",
)


def value(fdp: atheris.FuzzedDataProvider, depth: int) -> object:
    kind = fdp.ConsumeIntInRange(0, 7 if depth < 5 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(1 << 40), 1 << 40)
    if kind == 3:
        return fdp.PickValueInList(list(WORDS))
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 5:
        return [value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    keys = list(KEYS) + list(WORDS)
    return {fdp.PickValueInList(keys): value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 5))}


def spec_from(data: bytes) -> bytes:
    fdp = atheris.FuzzedDataProvider(data)
    spec = {"root": {"path": fdp.PickValueInList(["rootfs", "linked", "filed", "/", ""])}}
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        spec[fdp.PickValueInList(list(KEYS))] = value(fdp, 0)
    return json.dumps(spec).encode()


def shim_may_ask(raw: bytes) -> bool:
    if any(m in raw for m in SHIM_MARKERS):
        return True
    for i in range(len(raw) - 5):
        m = _NAME_ESCAPE.match(raw, i)
        if m:
            c = chr(int(m.group(1), 16))
            if c.isascii() and (c.isalnum() or c in "_/"):
                return True
    return False


def instance(instance_id: str, enforced: bool) -> Instance:
    grants = (Grant(0, "GPU-aaaa", 2 * GIB, 30),)
    return Instance(instance_id, Owner(OwnerKind.CONTAINER, "c1@/b"), grants, InstanceState.RESERVED, enforced)


class Harness:
    def __init__(self, root: Path) -> None:
        self.bundle = root / "bundle"
        self.regions = root / "regions"
        self.files = RuntimeFiles(
            root / "runtime" / "libcgpu.so",
            root / "runtime" / "ld.so.preload",
            root / "runtime" / "cgpu-hook",
            root / "relay.sock",
        )
        for tree in ("rootfs", "linked", "filed"):
            for d in ("run", "etc", "usr/local", "proc"):
                (self.bundle / tree / d).mkdir(parents=True, exist_ok=True)
        os.symlink("/proc/self", self.bundle / "linked" / "run" / "cgpu")
        os.symlink("/etc/shadow", self.bundle / "linked" / "etc" / "ld.so.preload")
        (self.bundle / "filed" / "usr" / "local" / "cgpu").write_text("not a directory\n")
        (self.regions / "cgpu-0000aaaa").mkdir(parents=True)

    def one(self, data: bytes) -> None:
        flags, raw = (data[0], data[1:]) if data else (0, b"")
        if flags & 4:
            raw = spec_from(raw)
        raw = raw.replace(b"REGIONS/", str(self.regions).encode() + b"/")
        (self.bundle / "config.json").write_bytes(raw)
        try:
            spec = read_spec(self.bundle)
            ask = read_request(spec, trust_env=bool(flags & 1), regions=self.regions)
            if ask is not None and not shim_may_ask(raw):
                raise AssertionError(f"cgpud reads {ask} from a config the shim would start without asking")
            inst = instance(ask.instance_id if isinstance(ask, Claim) else "cgpu-0000aaaa", bool(flags & 2))
            edits = instance_edits(inst, self.regions / inst.id, GPU_MEMORY, self.files)
            targets = [m.destination for m in edits.mounts]
            rootfs = rootfs_path(self.bundle, spec)
            check_targets(rootfs, targets)
            check_volumes(rootfs, spec.get("mounts", []), targets, ours={m.destination for m in edits.mounts})
            out = apply_edits(spec, edits, self.files)
            write_spec(self.bundle, out)
        except CgpuError as e:
            if not str(e) or "\n" in str(e):
                raise AssertionError(f"refusal {str(e)!r} is not one line") from e
            return
        again = read_spec(self.bundle)
        if json.dumps(again) != json.dumps(out):
            raise AssertionError("the spec written back reads differently")
        if json.dumps(apply_edits(again, edits, self.files)) != json.dumps(again):
            raise AssertionError("editing an edited spec again changed it")
        found = read_request(again, trust_env=False, regions=self.regions)
        expected = Claim(inst.id) if inst.enforced else None  # share mode: /run/cgpu is cleared, not claimed
        if found != expected:
            raise AssertionError(f"the edited spec asks for {found}, not {expected}")


def main() -> None:
    harness = Harness(Path(tempfile.mkdtemp(prefix="cgpu-fuzz-bundle-")))
    atheris.Setup(sys.argv, harness.one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
