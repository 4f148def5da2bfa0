"""Compute share: two tenants asking 30 % and 70 % of GPU 0, both saturating
it with spin kernels of several lengths and with graphs, under the `fixed`
and `fair` policies and under native time slicing; and under `fixed` with
`--fixed-windows`, where each tenant keeps to its own window of the period
by itself (compute.fixed-windows.*; docs/compute.md); and under `fair` with
`--busy-windows`, where two busy tenants keep to equal windows once the
slices have shown them busy (compute.busy-windows.*).

A tenant's share is its achieved kernel throughput (kernel time completed
per wall second, from cgpu-burn's own report) over the throughput of the
same workload alone on the GPU: it needs no per-process accounting, so it
reads the same on a real GPU and on any driver."""

from __future__ import annotations

import subprocess
from functools import partial
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

from bench.gpu_check.model import CheckError, CheckResult
from bench.gpu_check.rig import Cgpud, Rig, json_line, kill_group
from bench.gpu_check.runner import Runner, verdict

GROUP = "compute"
SHARES = (30, 70)


@dataclass(frozen=True)
class Shape:
    name: str
    kernel_ns: int
    args: tuple[str, ...] = ()

    def burn_args(self, seconds: float) -> list[str]:
        return ["--duration", str(seconds), "--kernel-ns", str(self.kernel_ns), *self.args]


SHAPES = {
    "100us": Shape("100us", 100_000),
    "1ms": Shape("1ms", 1_000_000),
    "10ms": Shape("10ms", 10_000_000),
    "graph": Shape("graph", 1_000_000, ("--launch-api", "graph", "--graph-nodes", "4")),
}
# (policy, shapes): every shape under fixed, the common one under the others
PLAN_FULL = (("fixed", ("100us", "1ms", "10ms", "graph")), ("fair", ("1ms", "graph")), ("native", ("1ms", "graph")))
PLAN_QUICK = (("fixed", ("1ms", "10ms", "graph")), ("fair", ("1ms",)), ("native", ("1ms",)))
# Shapes under `fixed` with --fixed-windows, on a cgpud of their own.
WINDOWS_FULL = ("100us", "1ms", "10ms", "graph")
WINDOWS_QUICK = ("1ms", "10ms")
# Shapes under `fair` with --busy-windows, on a cgpud of their own.
BUSY_FULL = ("1ms", "10ms", "graph")
BUSY_QUICK = ("1ms",)


def rate(burn: dict[str, Any]) -> float:
    """Kernel time completed per wall second."""
    wall = float(burn["wall_s"])
    if wall <= 0 or burn.get("errors"):
        raise CheckError(f"cgpu-burn ran nothing or failed: {burn.get('errors')}")
    return int(burn["launches"]) * int(burn["kernel_ns"]) / 1e9 / wall


@dataclass
class Tenants:
    """Tenants started together; reports() waits for them, and they are
    killed if they are still running when it gives up (or fails)."""

    procs: list[tuple[str, subprocess.Popen[str]]]

    def reports(self, timeout: float) -> dict[str, dict[str, Any]]:
        """Each tenant's cgpu-burn report by name."""
        out = {}
        deadline = time.monotonic() + timeout
        try:
            for name, p in self.procs:
                try:
                    stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise CheckError(f"the {name} tenant did not finish within {timeout:.0f} s") from None
                if p.returncode != 0:
                    raise CheckError(f"the {name} tenant exited {p.returncode}: {stderr.strip()[-300:]}")
                out[name] = json_line(stdout, f"{name} tenant", '{"device"')
        finally:
            self.kill()
        return out

    def kill(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                kill_group(p)
                p.wait()


def start_tenants(rig: Rig, d: Cgpud, tenants: Sequence[tuple[str, int, Sequence[str]]]) -> Tenants:
    """Each (name, share, cgpu-burn arguments) started at once under
    `cgpuctl run --core share`; none left running if one cannot start."""
    started = Tenants([])
    try:
        for name, core, args in tenants:
            proc = subprocess.Popen(
                d.run_argv(f"{rig.options.mem_gib}GiB", str(rig.tools.burn), *args, core=core),
                env=rig.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            started.procs.append((name, proc))
    except BaseException:
        started.kill()
        raise
    return started


def start_pair(rig: Rig, d: Cgpud, shape: Shape, seconds: float) -> Tenants:
    """The 30 % and 70 % tenants of `shape`, started at once."""
    return start_tenants(rig, d, [(f"{core} %", core, shape.burn_args(seconds)) for core in SHARES])


def together(rig: Rig, d: Cgpud, shape: Shape, seconds: float) -> list[dict[str, Any]]:
    """The two tenants started at once, each cgpu-burn's report."""
    return list(start_pair(rig, d, shape, seconds).reports(seconds + 60).values())


def expected(policy: str, tol: float, busy: float) -> tuple[str, Callable[[list[float]], bool]]:
    """What the shares (fractions of the throughput alone) must be: the
    split between the two within `tol` of the policy's, neither above its
    split by more than `tol`, and together at least `busy` of the GPU (a
    host short of CPU slows both tenants alike: the split shows the
    scheduler, the sum what the GPU lost)."""
    split = [c / 100 for c in SHARES] if policy == "fixed" else [0.5, 0.5]

    def ok(shares: list[float]) -> bool:
        total = sum(shares)
        if total < busy:
            return False
        if policy == "native":
            return True
        return all(abs(x / total - want) <= tol and x <= want + tol for x, want in zip(shares, split))

    want = "/".join(f"{w * 100:.0f}" for w in split)
    if policy == "native":
        return f"GPU kept busy: sum >= {busy * 100:.0f}", ok
    return f"split {want} +-{tol * 100:.0f}, sum >= {busy * 100:.0f}", ok


class Alone:
    """Each shape's throughput alone on the GPU: measured again before each
    pair of tenants, the best so far kept, so a busy host (another
    process waking late after a sync) does not lower the reference."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.best: dict[str, float] = {}

    def __call__(self, shape: Shape) -> float:
        burn = self.rig.burn(shape.burn_args(self.rig.seconds(1.0, 3.0)), 60, f"{shape.name} alone")
        self.best[shape.name] = max(self.best.get(shape.name, 0.0), rate(burn))
        return self.best[shape.name]


def share_check(rig: Rig, d: Cgpud, policy: str, shape: Shape, alone: Alone) -> CheckResult:
    seconds = rig.seconds(2.5, 10.0)
    tol = rig.seconds(0.08, 0.05)
    busy = rig.seconds(0.80, 0.85)
    alone(shape)
    burns = together(rig, d, shape, seconds)
    reference = alone(shape)
    shares = [rate(b) / reference for b in burns]
    want, ok = expected(policy, tol, busy)
    return CheckResult(
        "",
        GROUP,
        verdict(ok(shares)),
        figure="/".join(f"{s * 100:.1f}" for s in shares) + f" (sum {sum(shares) * 100:.0f})",
        expected=want,
        detail="" if ok(shares) else "shares of the throughput alone: " + "/".join(f"{s:.3f}" for s in shares),
        values={
            "policy": policy,
            "shape": shape.name,
            "kernel_ns": shape.kernel_ns,
            "asked": list(SHARES),
            "shares": shares,
            "split": [x / sum(shares) for x in shares] if sum(shares) > 0 else [],
            "sum": sum(shares),
            "alone_rate": reference,
            "rates": [rate(b) for b in burns],
            "seconds": seconds,
        },
    )


def run(rig: Rig, runner: Runner) -> None:
    plan = PLAN_QUICK if rig.options.quick else PLAN_FULL
    names = tuple(f"compute.{policy}.{shape}" for policy, shapes in plan for shape in shapes)
    windows = WINDOWS_QUICK if rig.options.quick else WINDOWS_FULL
    window_names = tuple(f"compute.fixed-windows.{shape}" for shape in windows)
    busy = BUSY_QUICK if rig.options.quick else BUSY_FULL
    busy_names = tuple(f"compute.busy-windows.{shape}" for shape in busy)
    alone = Alone(rig)
    if any(runner.wanted(n) for n in names):
        try:
            with rig.cgpud("compute", "--mode", "core_mem", "--compute-policy", "3") as d:
                for policy, shapes in plan:
                    d.cgpuctl("policy", "set", policy)
                    for s in shapes:
                        check = partial(share_check, rig, d, policy, SHAPES[s], alone)
                        runner.check(f"compute.{policy}.{s}", GROUP, check)
        except CheckError as e:
            runner.fail_rest(names, GROUP, str(e))
    # Each option on a cgpud of its own.
    for label, policy, number, option, shapes, checks in (
        ("windows", "fixed", "3", "--fixed-windows", windows, window_names),
        ("busy", "fair", "0", "--busy-windows", busy, busy_names),
    ):
        if not any(runner.wanted(n) for n in checks):
            continue
        try:
            with rig.cgpud(label, "--mode", "core_mem", "--compute-policy", number, option) as d:
                for s, name in zip(shapes, checks):
                    runner.check(name, GROUP, partial(share_check, rig, d, policy, SHAPES[s], alone))
        except CheckError as e:
            runner.fail_rest(checks, GROUP, str(e))
