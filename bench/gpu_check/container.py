"""Container: a runc container holds its memory limit, started two ways:
through cgpu-runtime (the shim asks cgpud for an instance from the bundle's
ALIYUN_COM_GPU_MEM_CONTAINER), and by plain runc with the CDI device of an
instance from `cgpuctl cdi generate` (device nodes from the real driver's
/dev/nvidia*) applied to the bundle as a CDI-aware engine applies it.

The image is minimal: cgpu-burn and the C library it needs. The driver is
the host's, as the NVIDIA toolkit provides it: the directories the dynamic
loader finds libcuda.so.1 and libnvidia-ml.so.1 in are mounted read-only at
/run/cgpu-check/driver/N with LD_LIBRARY_PATH naming them, and on the shim's
path the /dev/nvidia* nodes are the bundle's. Variables named in
CGPU_CHECK_CONTAINER_ENV (space-separated) are passed into the container,
with the directory of a path they name mounted at the same place: a driver
whose files live elsewhere (a driver container's root) is reached that way."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

from bench.gpu_check.model import CheckError, CheckResult, Skip
from bench.gpu_check.rig import Cgpud, Rig, json_line
from bench.gpu_check.rig import run as run_command
from bench.gpu_check.runner import Runner, verdict

GROUP = "container"
GIB = 1 << 30
PASS_ENV = "CGPU_CHECK_CONTAINER_ENV"
DRIVER_DIR = "/run/cgpu-check/driver"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FIND_DRIVER = """
import ctypes, json
for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
    ctypes.CDLL(name)
found = {}
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        if path.startswith("/") and path.rsplit("/", 1)[-1].startswith(name.split(".so")[0] + ".so"):
            found[name] = path
print(json.dumps(found))
"""


def driver_dirs(rig: Rig) -> list[str]:
    """The directories the loader found the driver's libraries in."""
    out = rig.run([sys.executable, "-c", FIND_DRIVER], 30, "finding the driver libraries").stdout
    found = json_line(out, "finding the driver libraries")
    if set(found) != {"libcuda.so.1", "libnvidia-ml.so.1"}:
        raise CheckError(f"the loader did not find both driver libraries: {found}")
    return list(dict.fromkeys(str(Path(p).parent) for p in found.values()))


def shared_libs(binary: Path) -> list[Path]:
    out = run_command(["ldd", str(binary)], dict(os.environ), 30, f"ldd {binary}").stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else (parts[0] if parts else "")
        if path.startswith("/"):
            libs.append(Path(path))
    return libs


def rootfs(rig: Rig, root: Path) -> Path:
    if root.exists():
        return root
    for d in ("etc", "tmp", "proc", "sys", "dev", "run", "usr/bin"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(rig.tools.burn, root / "usr/bin/cgpu-burn")
    for binary in (rig.tools.burn, rig.tools.libcgpu):
        for lib in shared_libs(binary):
            dest = root / str(lib).lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib.resolve(), dest)
    (root / "etc/passwd").write_text("root:x:0:0:root:/:/bin/false\n")
    return root


def device_nodes() -> list[dict[str, Any]]:
    """The host's /dev/nvidia* character devices, as OCI linux.devices."""
    nodes = []
    for p in sorted(Path("/dev").glob("nvidia*")):
        try:
            st = p.stat()
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            nodes.append(
                {
                    "path": str(p),
                    "type": "c",
                    "major": os.major(st.st_rdev),
                    "minor": os.minor(st.st_rdev),
                    "fileMode": 0o666,
                }
            )
    return nodes


def bundle(rig: Rig, where: Path, env: list[str], nodes: list[dict[str, Any]]) -> Path:
    where.mkdir(parents=True)
    made = subprocess.run(["runc", "spec"], cwd=where, capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        raise CheckError(f"runc spec: {made.stderr.strip()}")
    spec = json.loads((where / "config.json").read_text())
    root = rootfs(rig, rig.work / "container" / "rootfs")
    spec["root"] = {"path": str(root), "readonly": False}
    dirs = driver_dirs(rig)
    mounts = [
        {"destination": f"{DRIVER_DIR}/{i}", "type": "bind", "source": d, "options": ["rbind", "ro"]}
        for i, d in enumerate(dirs)
    ]
    passed = []
    for name in os.environ.get(PASS_ENV, "").split():
        value = rig.env.get(name)
        if value is None:
            raise CheckError(f"{PASS_ENV} names {name}, which is not set")
        passed.append(f"{name}={value}")
        if value.startswith("/") and Path(value).exists():
            parent = str(Path(value).parent)
            mounts.append({"destination": parent, "type": "bind", "source": parent, "options": ["rbind", "rw"]})
    spec["mounts"] += mounts
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/usr/bin/cgpu-burn", "--alloc-until-fail", "256MiB"]
    ld_path = ":".join(f"{DRIVER_DIR}/{i}" for i in range(len(dirs)))
    spec["process"]["env"] = [PATH_ENV, f"LD_LIBRARY_PATH={ld_path}", *passed, *env]
    linux = spec.setdefault("linux", {})
    linux.setdefault("devices", []).extend(nodes)
    allow = linux.setdefault("resources", {}).setdefault("devices", [])
    allow.extend({"allow": True, "type": "c", "major": n["major"], "minor": n["minor"], "access": "rwm"} for n in nodes)
    (where / "config.json").write_text(json.dumps(spec, indent=1))
    return where


def apply_cdi(where: Path, device: dict[str, Any]) -> None:
    """The CDI device's edits on the bundle, as containerd applies them."""
    spec = json.loads((where / "config.json").read_text())
    edits = device.get("containerEdits", {})
    spec["process"]["env"] += edits.get("env", [])
    spec["mounts"] = sorted(
        spec["mounts"]
        + [
            {
                "destination": m["containerPath"],
                "source": m["hostPath"],
                "type": m.get("type", ""),
                "options": m.get("options", []),
            }
            for m in edits.get("mounts", [])
        ],
        key=lambda m: len(Path(m["destination"]).parts),
    )
    hooks = spec.setdefault("hooks", {})
    for h in edits.get("hooks", []):
        hooks.setdefault(h["hookName"], []).append({k: h[k] for k in ("path", "args", "env", "timeout") if k in h})
    linux = spec.setdefault("linux", {})
    for node in edits.get("deviceNodes", []):
        st = os.stat(node.get("hostPath", node["path"]))
        major, minor = node.get("major", os.major(st.st_rdev)), node.get("minor", os.minor(st.st_rdev))
        linux.setdefault("devices", []).append({"path": node["path"], "type": "c", "major": major, "minor": minor})
        linux.setdefault("resources", {}).setdefault("devices", []).append(
            {"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}
        )
    (where / "config.json").write_text(json.dumps(spec, indent=1))


def result(rig: Rig, burn: dict[str, Any], how: str, nodes: int) -> CheckResult:
    limit = rig.options.mem_gib * GIB
    got, seen = int(burn["alloc"]["until_fail_bytes"]), int(burn["mem_total_reported"])
    ok = seen == limit and limit - GIB // 4 < got <= limit
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"sees {seen >> 20} MiB, got {got >> 20} MiB ({nodes} device nodes)",
        expected=f"sees and gets {limit >> 20} MiB ({how})",
        detail="" if ok else f"refused with {burn['alloc']['until_fail_result']}",
        values={"limit": limit, "seen_total": seen, "allocated": got, "device_nodes": nodes},
    )


def through_shim(rig: Rig, d: Cgpud) -> CheckResult:
    nodes = device_nodes()
    b = bundle(rig, rig.work / "container" / "shim", [f"ALIYUN_COM_GPU_MEM_CONTAINER={rig.options.mem_gib}"], nodes)
    env = dict(rig.env, CGPU_RELAY_SOCKET=str(d.relay), CGPU_REAL_RUNTIME=shutil.which("runc") or "runc")
    state = rig.work / "container" / "runc"
    cid = f"cgpu-gpu-check-shim-{os.getpid()}"
    try:
        out = run_command(
            [str(rig.tools.runtime), "--root", str(state), "run", "--bundle", str(b), cid], env, 120, "cgpu-runtime run"
        )
    finally:
        subprocess.run(["runc", "--root", str(state), "delete", "--force", cid], capture_output=True, timeout=30)
    return result(rig, json_line(out.stdout, "the container's cgpu-burn", '{"device"'), "cgpu-runtime", len(nodes))


def through_cdi(rig: Rig, d: Cgpud) -> CheckResult:
    iid = d.cgpuctl("create", "--mem", f"{rig.options.mem_gib}GiB", "--name", "gpu-check-cdi").stdout.strip()
    try:
        spec_file = rig.work / "container" / "cdi.json"
        d.cgpuctl("cdi", "generate", "--output", str(spec_file))
        spec = json.loads(spec_file.read_text())
        [device] = [x for x in spec["devices"] if x["name"] == iid]
        b = bundle(rig, rig.work / "container" / "cdi", [], [])
        apply_cdi(b, device)
        nodes = len(spec.get("containerEdits", {}).get("deviceNodes", [])) + len(
            device["containerEdits"].get("deviceNodes", [])
        )
        # spec-level edits (the driver's nodes) too
        apply_cdi(b, {"containerEdits": spec.get("containerEdits", {})})
        state = rig.work / "container" / "runc"
        cid = f"cgpu-gpu-check-cdi-{os.getpid()}"
        try:
            out = run_command(
                ["runc", "--root", str(state), "run", "--bundle", str(b), cid], rig.env, 120, "runc run (CDI)"
            )
        finally:
            subprocess.run(["runc", "--root", str(state), "delete", "--force", cid], capture_output=True, timeout=30)
    finally:
        d.cgpuctl("release", iid, check=False)
    return result(rig, json_line(out.stdout, "the container's cgpu-burn", '{"device"'), "CDI", nodes)


def run(rig: Rig, runner: Runner) -> None:
    names = ("container.shim", "container.cdi")
    if not any(runner.wanted(n) for n in names):
        return
    reason = ""
    if os.geteuid() != 0:
        reason = "container: runc needs root"
    elif shutil.which("runc") is None:
        reason = "container: runc not installed"
    if reason:
        for name in names:
            runner.check(name, GROUP, partial(_skip, reason))
        return
    try:
        with rig.cgpud("container", "--mode", "cgpu") as d:
            runner.check("container.shim", GROUP, partial(through_shim, rig, d))
            runner.check("container.cdi", GROUP, partial(through_cdi, rig, d))
    except CheckError as e:
        runner.fail_rest(names, GROUP, str(e))


def _skip(reason: str) -> CheckResult:
    raise Skip(reason)
