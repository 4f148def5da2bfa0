"""Shares hold while cgpud is away (issue 39): under `fixed`, tenants of 30 %
and 70 % saturating GPU 0 keep their split within 5 points while cgpud is
killed (SIGKILL, as a crash) for 10 s and started again, and no launch of
theirs waits longer than the gate's bound meanwhile. Each tenant paces itself
to the window cgpud tiled for it while it ran (docs/compute.md).

The shares are each tenant's throughput over its whole run, most of which
(10 s of about 13) lies in the outage: a gate that failed open there would
show as the two near 50/50 (the driver's own time slicing)."""

from __future__ import annotations

import time
from typing import Any

from bench.gpu_check.compute import SHAPES, SHARES, Alone, rate, start_pair
from bench.gpu_check.model import CheckError, CheckResult
from bench.gpu_check.rig import Rig
from bench.gpu_check.runner import Runner, verdict

GROUP = "away"
NAME = "away.fixed"
# A launch waiting at the closed gate when cgpud goes has waited up to a
# period (100 ms) for its grant already; it finds cgpud gone within its
# 50 ms probe, then waits at most for its own window (within a period) and
# its queue's drain, plus a late wake-up on a loaded machine
# (tests/integration/test_compute_failure.py uses the same bound).
STALL_BOUND_MS = 300.0
BEFORE_S = 1.5  # with cgpud, tenants running, before the kill
AFTER_S = 1.5  # with cgpud started again, before the tenants end


def split_of(shares: list[float]) -> list[float]:
    """Each tenant's part of what the two ran; empty when they ran nothing."""
    total = sum(shares)
    return [s / total for s in shares] if total > 0 else []


def judge(shares: list[float], stalls: list[float], tol: float) -> tuple[bool, str]:
    """Whether the split held within `tol` and no launch waited past the bound; why not."""
    split = split_of(shares)
    if not split:
        return False, "the tenants ran nothing"
    off = [abs(x - c / 100) for x, c in zip(split, SHARES)]
    if max(off) > tol:
        got = "/".join(f"{x * 100:.1f}" for x in split)
        return False, f"split {got} while cgpud was away, asked {SHARES[0]}/{SHARES[1]}"
    if max(stalls) >= STALL_BOUND_MS:
        return False, f"a launch waited {max(stalls):.0f} ms (bound {STALL_BOUND_MS:.0f} ms)"
    return True, ""


def away_check(rig: Rig, alone: Alone) -> CheckResult:
    away_s = rig.seconds(4.0, 10.0)
    tol = rig.seconds(0.08, 0.05)
    shape = SHAPES["1ms"]
    seconds = BEFORE_S + away_s + AFTER_S
    alone(shape)
    with rig.cgpud("away", "--mode", "core_mem", "--compute-policy", "3") as d:
        tenants = start_pair(rig, d, shape, seconds)
        try:
            time.sleep(BEFORE_S)
            d.kill()
            time.sleep(away_s)
            d.start()
            reports: dict[str, dict[str, Any]] = tenants.reports(seconds + 60)
        finally:
            tenants.kill()
    reference = alone(shape)
    shares = [rate(r) / reference for r in reports.values()]
    stalls = [float(r.get("max_launch_ms", 0.0)) for r in reports.values()]
    ok, why = judge(shares, stalls, tol)
    split = split_of(shares)
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure="/".join(f"{x * 100:.1f}" for x in split) if split else "nothing ran",
        expected=f"split {SHARES[0]}/{SHARES[1]} +-{tol * 100:.0f} over {away_s:g} s away, "
        f"launches < {STALL_BOUND_MS:.0f} ms",
        detail=why,
        values={
            "asked": list(SHARES),
            "shares": shares,
            "split": split,
            "max_launch_ms": stalls,
            "away_seconds": away_s,
            "seconds": seconds,
            "alone_rate": reference,
        },
    )


def run(rig: Rig, runner: Runner) -> None:
    if not runner.wanted(NAME):
        return
    try:
        runner.check(NAME, GROUP, lambda: away_check(rig, Alone(rig)))
    except CheckError as e:
        runner.fail(NAME, GROUP, str(e))
