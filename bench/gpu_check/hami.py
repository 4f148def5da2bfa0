"""HAMi-core side by side (only with --hami PATH to its libvgpu.so): the
same memory, share and overhead measurements as cgpu's, on the same
kernels, with HAMi's own settings (CUDA_DEVICE_MEMORY_LIMIT,
CUDA_DEVICE_SM_LIMIT) and its shared cache file in the run's directory.
These are comparisons: a check passes when it measured, and its figure
says what HAMi held; cgpu's own promises are the other groups' checks."""

from __future__ import annotations

import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

from bench.gpu_check.compute import SHAPES, rate
from bench.gpu_check.model import CheckError, CheckResult, Skip, Status
from bench.gpu_check.rig import Rig, json_line, kill_group
from bench.gpu_check.runner import Runner

GROUP = "hami"
GIB = 1 << 30


def hami_env(rig: Rig, library: Path, sm_limit: int | None = None, name: str = "shared") -> dict[str, str]:
    env = dict(rig.env)
    env["LD_PRELOAD"] = str(library)
    env["CUDA_DEVICE_MEMORY_LIMIT"] = f"{rig.options.mem_gib * 1024}m"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(rig.work / f"hami-{name}.cache")
    if sm_limit is not None:
        env["CUDA_DEVICE_SM_LIMIT"] = str(sm_limit)
    return env


def memory(rig: Rig, library: Path) -> CheckResult:
    limit = rig.options.mem_gib * GIB
    burn = rig.burn(["--alloc-until-fail", "256MiB"], 60, "cgpu-burn under HAMi", env=hami_env(rig, library))
    seen, got = int(burn["mem_total_reported"]), int(burn["alloc"]["until_fail_bytes"])
    held = seen == limit and got <= limit
    return CheckResult(
        "",
        GROUP,
        Status.PASS,
        figure=f"HAMi: sees {seen >> 20} MiB, got {got >> 20} MiB",
        expected=f"measured (cgpu: sees and gets {limit >> 20} MiB)",
        detail="" if held else "HAMi did not hold the limit",
        values={"limit": limit, "seen_total": seen, "allocated": got, "held": held},
    )


def share(rig: Rig, library: Path) -> CheckResult:
    shape = SHAPES["1ms"]
    seconds = rig.seconds(2.5, 10.0)
    alone = rate(rig.burn(shape.burn_args(rig.seconds(1.5, 4.0)), 60, "1ms alone"))
    procs = [
        subprocess.Popen(
            [str(rig.tools.burn), *shape.burn_args(seconds)],
            env=hami_env(rig, library, sm, f"share{sm}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for sm in (30, 70)
    ]
    deadline = time.monotonic() + seconds + 60
    shares = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise CheckError(f"a HAMi tenant exited {p.returncode}: {err.strip()[-200:]}")
            shares.append(rate(json_line(out, "HAMi tenant", '{"device"')) / alone)
    except subprocess.TimeoutExpired:
        raise CheckError("a HAMi tenant did not finish in time") from None
    finally:
        for p in procs:
            if p.poll() is None:
                kill_group(p)
                p.wait()
    return CheckResult(
        "",
        GROUP,
        Status.PASS,
        figure="HAMi: " + "/".join(f"{s * 100:.1f}" for s in shares),
        expected="measured (cgpu fixed: 30/70)",
        values={"asked": [30, 70], "shares": shares, "alone_rate": alone},
    )


def overhead(rig: Rig, library: Path) -> CheckResult:
    calls = str(int(rig.seconds(20_000, 100_000)))
    bare: list[float] = []
    hami: list[float] = []
    for r in range(int(rig.seconds(3, 5))):
        sides = [("bare", dict(rig.env)), ("hami", hami_env(rig, library))]
        for side, env in sides if r % 2 == 0 else reversed(sides):
            out = rig.run([str(rig.tools.calls), "launch", calls], 120, f"intercept_calls launch ({side})", env=env)
            (bare if side == "bare" else hami).append(float(json_line(out.stdout, "intercept_calls")["ns_per_call"]))
    added = statistics.median(hami) - statistics.median(bare)
    return CheckResult(
        "",
        GROUP,
        Status.PASS,
        figure=f"HAMi: cuLaunchKernel {added:+.1f} ns",
        expected="measured (cgpu: overhead.launch)",
        values={"bare_ns": bare, "hami_ns": hami, "added_ns": added},
    )


def _skip(reason: str) -> CheckResult:
    raise Skip(reason)


def run(rig: Rig, runner: Runner) -> None:
    checks = {"hami.memory": memory, "hami.share": share, "hami.overhead": overhead}
    library = rig.options.hami
    for name, fn in checks.items():
        if library is None:
            runner.check(name, GROUP, partial(_skip, "HAMi: no --hami path given"))
        else:
            runner.check(name, GROUP, partial(fn, rig, library))
