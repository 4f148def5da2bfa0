"""Compute-share accuracy under NVIDIA MPS on the simulated GPU, side by
side with its baselines.

Each scenario runs saturating `cgpu-burn` tenants (asynchronous launches
over 4 streams) three ways, interleaved round by round (each round starts
one arm further along), and takes each tenant's share of the GPU's work
from the simulation's own per-process accounting (`cgpu-sim-stat
--sample`; an MPS client's time counts at its part of the SMs):

- mps: a real cgpud in mps mode, tenants under `cgpuctl run --core N`: MPS
  clients of the GPU's control daemon at N % active threads, their kernels
  running at once;
- native: the same processes on the simulated driver alone (no cgpud, no
  MPS): the driver time-slices the contexts, whatever they asked;
- cgpu fixed: a real cgpud in core_mem mode, compute policy fixed (cgpu's
  time-slice scheduler), tenants under `cgpuctl run --core N`.

The median over the rounds is reported. It is a report: exit 0 whether or
not a share is met, 1 when it could not measure. Run from the repository
root:
    .venv/bin/python -m bench.bench_mps [--rounds 3] [--seconds 5] [--only 30/70]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.table import print_table
from tests.harness.sharerun import Scenario, ScenarioResult, ShareRig, TenantSpec


def scenarios(seconds: float) -> list[Scenario]:
    mix = (20_000, 200_000, 2_000_000)
    return [
        Scenario("30/70", "fixed", (TenantSpec(30), TenantSpec(70)), seconds),
        Scenario("10/90, 20 us vs 2 ms kernels", "fixed", (TenantSpec(10, 20_000), TenantSpec(90, 2_000_000)), seconds),
        Scenario("4 x 25, mixed kernels", "fixed", tuple(TenantSpec(25, mix[i % 3]) for i in range(4)), seconds),
    ]


ARMS = ("mps", "native", "cgpu fixed")


def run_arm(arm: str, sc: Scenario, mps: ShareRig, core: ShareRig) -> ScenarioResult:
    if arm == "mps":
        return mps.run(sc)
    if arm == "native":  # on the core_mem rig's GPU: its compute mode is Default
        return core.run(sc, native=True)
    return core.run(sc)


def median(results: list[ScenarioResult], value: Callable[[ScenarioResult], float]) -> float:
    return statistics.median(value(r) for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured interval per run (5)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per arm; the median is reported (3)")
    ap.add_argument("--only", help="run the scenarios whose name contains this")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        print("--rounds must be 1 or more and --seconds above 0", file=sys.stderr)
        return 2
    chosen = [s for s in scenarios(args.seconds) if not args.only or args.only in s.name]
    if not chosen:
        print(f"no scenario matches {args.only!r}", file=sys.stderr)
        return 2
    print(
        f"# shares under MPS, natively and under cgpu's fixed policy: {len(chosen)} scenarios, "
        f"{args.rounds} rounds of {args.seconds:g} s, load {os.getloadavg()[0]:.2f}"
    )
    summary = []
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-mps-") as tmp:
        mps = ShareRig(Path(tmp) / "mps", dict(os.environ), "--mode", "mps")
        core = ShareRig(Path(tmp) / "core", dict(os.environ))
        try:
            for sc in chosen:
                results: dict[str, list[ScenarioResult]] = {a: [] for a in ARMS}
                for r in range(args.rounds):
                    for k in range(len(ARMS)):
                        arm = ARMS[(k + r) % len(ARMS)]
                        results[arm].append(run_arm(arm, sc, mps, core))
                print(f"\n## {sc.name}  (median of {args.rounds} rounds, {sc.seconds:g} s each)")
                rows = []
                for i, t in enumerate(sc.tenants):
                    rows.append(
                        (
                            f"tenant {i} (core {t.core} %, {t.kernel_ns / 1000:g} us kernels)",
                            *(f"{statistics.median(x.tenants[i].share for x in results[a]):.2f}" for a in ARMS),
                        )
                    )
                rows.append(("mean |error| pt", *(f"{median(results[a], lambda x: x.mean_error):.2f}" for a in ARMS)))
                rows.append(("GPU busy %", *(f"{median(results[a], lambda x: x.utilisation):.1f}" for a in ARMS)))
                print_table(("% of the GPU's work", *ARMS), rows)
                summary.append((sc.name, *(f"{median(results[a], lambda x: x.mean_error):.2f}" for a in ARMS)))
        finally:
            mps.close()
            core.close()
    print("\n## summary: mean |achieved - requested| in points (median of rounds)")
    print_table(("scenario", *ARMS), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
