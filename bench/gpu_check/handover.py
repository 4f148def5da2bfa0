"""Hand-over (issue 39): a bursty tenant beside a saturating one, both with a
share as users ask for one (`--core 30`, `--core 70`), under the policies
that lend idle time (fair, preemptive, weighted). While the bursty tenant
sleeps between bursts the GPU must go to the other: the two together keep
it at least 95 % as busy as the saturating workload alone, whatever way the
bursty tenant waits for its burst's end.

The GPU's busy fraction is the two tenants' kernel throughput (kernel time
completed per wall second, from cgpu-burn's own reports) over the
saturating workload's alone: gated tenants never run at once, so their
throughputs add up to the device time used. Native time slicing is not the
reference: there a spin kernel's clock runs while its context is switched
out, which overstates both tenants (compute.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from bench.gpu_check.compute import Alone, Shape, rate, start_tenants
from bench.gpu_check.model import CheckError, CheckResult
from bench.gpu_check.rig import Cgpud, Rig
from bench.gpu_check.runner import Runner, verdict

GROUP = "handover"
SATURATING = Shape("saturating", 500_000, ("--streams", "2"))
# bench/bench_compute.py's burst shape: 20 kernels of 0.3 ms over two
# streams, then 20 ms asleep.
BURSTY = Shape("bursty", 300_000, ("--streams", "2", "--burst-ms", "6", "--gap-ms", "20"))
SHARES = {"saturating": 70, "bursty": 30}
POLICIES = ("fair", "preemptive", "weighted")
SYNCS = ("streams", "events", "query", "ctx", "none")  # cgpu-burn --burst-sync
QUICK = (("fair", ("streams", "query", "none")), ("preemptive", ("ctx",)), ("weighted", ("events",)))


@dataclass(frozen=True)
class Busy:
    """What the check judges, from the two reports and the reference."""

    saturating: float  # kernel seconds per wall second
    bursty: float
    alone: float  # the saturating workload alone

    @property
    def fraction(self) -> float:
        return (self.saturating + self.bursty) / self.alone if self.alone > 0 else 0.0


def plan(quick: bool) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return QUICK if quick else tuple((p, SYNCS) for p in POLICIES)


def names(quick: bool) -> tuple[str, ...]:
    return tuple(f"handover.{policy}.{sync}" for policy, syncs in plan(quick) for sync in syncs)


def pair(rig: Rig, d: Cgpud, sync: str, seconds: float) -> dict[str, dict[str, Any]]:
    """Both tenants started at once, each cgpu-burn's report by role."""
    tenants = start_tenants(
        rig,
        d,
        [
            ("saturating", SHARES["saturating"], SATURATING.burn_args(seconds)),
            ("bursty", SHARES["bursty"], [*BURSTY.burn_args(seconds), "--burst-sync", sync]),
        ],
    )
    return tenants.reports(seconds + 60)


def handover_check(rig: Rig, d: Cgpud, policy: str, sync: str, alone: Alone, least: float) -> CheckResult:
    seconds = rig.seconds(2.0, 5.0)
    burns = pair(rig, d, sync, seconds)
    busy = Busy(rate(burns["saturating"]), rate(burns["bursty"]), alone.best[SATURATING.name])
    ok = busy.fraction >= least
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"GPU {busy.fraction * 100:.1f} % busy",
        expected=f">= {least * 100:.0f} % of the saturating tenant alone",
        detail=""
        if ok
        else (
            f"throughput {busy.saturating:.3f} + {busy.bursty:.3f} (bursty, {sync}) against {busy.alone:.3f} "
            f"alone under {policy}: the GPU idled while the bursty tenant slept"
        ),
        values={
            "policy": policy,
            "burst_sync": sync,
            "asked": SHARES,
            "busy": busy.fraction,
            "rates": {"saturating": busy.saturating, "bursty": busy.bursty, "alone": busy.alone},
            "seconds": seconds,
        },
    )


def run(rig: Rig, runner: Runner) -> None:
    wanted: Sequence[str] = names(rig.options.quick)
    if not any(runner.wanted(n) for n in wanted):
        return
    # Issue 39's 95 %; with --quick (short runs on CI's shared 2-vCPU
    # machines, where a tenant short of CPU launches late) 93 %, still far
    # above the 74-79 % the GPU was busy before the hand-over learned these.
    least = rig.seconds(0.93, 0.95)
    alone = Alone(rig)
    try:
        with rig.cgpud("handover", "--mode", "core_mem") as d:
            for policy, syncs in plan(rig.options.quick):
                alone(SATURATING)  # bare, before each policy's checks: the best look is the reference
                d.cgpuctl("policy", "set", policy)
                for sync in syncs:
                    check = partial(handover_check, rig, d, policy, sync, alone, least)
                    runner.check(f"handover.{policy}.{sync}", GROUP, check)
    except CheckError as e:
        runner.fail_rest(tuple(wanted), GROUP, str(e))
