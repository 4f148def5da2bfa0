"""Detection latency and CPU cost of cgpud's bypass watchdog on the
simulated GPU.

Latency: two real cgpud side by side, one at the default
`--bypass-interval 1`, one at 0.2, both `--bypass-action kill`, each on its
own simulated 80 GiB GPU. A trial runs the ELF-walking bypass tenant
(`cgpu-bypass --resolve elf`, tests/harness/bypass_build.py) under `cgpuctl run
--mem 1`; it allocates 4 x 1 GiB past libcgpu and stamps each allocation
with CLOCK_REALTIME. Latency is from the allocation that took it past
limit + slack (the 2nd) to the event's time (cgpud's clock), and to the
process's death as its pidfd shows it. Trials alternate between the two
daemons.

CPU: three cgpud side by side with 20 `cgpuctl run --mem 1` instances each,
every one holding 512 MiB through libcgpu (cgpu-burn), so NVML lists 20
processes for the watchdog to map each round: `--bypass-interval 0`
(the watchdog off: the baseline), 1 and 0.2. Each round reads every
cgpud's CPU-time clock over the same wall time; rounds are medians.

It is a report: exit 0 whether or not a figure is good, 1 when it could not
measure. Run from the repository root:
    .venv/bin/python -m bench.bench_watchdog [--trials 50] [--rounds 6] [--seconds 10] [--seed 16] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.harness import free_port
from bench.table import print_table
from cgpud.native import native_path
from tests.harness.bypass_watch import GIB, MIB, Tenant, bypass_command, bypass_events, neighbour_command, run_tenant
from tests.harness.bypass_watch import wait_dead, wait_events, watch_flags
from tests.harness.sim import region_mounts as _region_mounts, write_sim_config
from tests.harness.daemon import Daemon, make_daemon
from tests.harness.sharerun import _process_cpu


def machine(where: Path) -> dict[str, str]:
    where.mkdir(parents=True)
    env = dict(os.environ)
    for name in ("LD_PRELOAD", "CGPU_REGION_DIR"):
        env.pop(name, None)
    env["LD_LIBRARY_PATH"] = str(native_path("sim"))
    env["CGPU_SIM_CONFIG"] = str(write_sim_config(where / "sim.conf", gpus=1, mem="80GiB"))
    env["CGPU_SIM_STATE"] = str(where / "sim.state")
    return env


@contextmanager
def daemon(where: Path, *flags: str) -> Iterator[Daemon]:
    # The production sweep interval: the tests' 0.2 s would weigh on cgpud's CPU time.
    d = make_daemon(where, machine(where / "gpu"), "--sweep-interval", "2", *flags)
    d.start()
    try:
        yield d
    finally:
        d.stop()


def unmount_regions(under: Path) -> None:
    """Instances cgpuctl had no time to release keep their tmpfs when cgpud
    stops (as they must across a restart): detached here."""
    from cgpud._region import lib

    for point in _region_mounts(under):
        lib.cgpu_region_unmount(point.encode())


def trial(d: Daemon, where: Path) -> tuple[float, float]:
    """One bypass tenant under `cgpuctl run --mem 1` killed by the watchdog:
    seconds from its crossing allocation to the event, and to its death."""
    tenant = run_tenant(d, "1", bypass_command("elf"), where)
    try:
        crossed = tenant.crossing(GIB)
        dead = wait_dead(tenant.pid, 30)
        if dead is None:
            raise RuntimeError(f"the watchdog did not kill tenant {tenant.pid} within 30 s")
        [event] = wait_events(d, lambda e: e["instance_id"] == tenant.instance_id, 10, "the tenant's event")
        tenant.proc.wait(timeout=30)  # cgpuctl releases the instance as its child dies
        return float(event["time"]) - crossed, dead - crossed
    finally:
        tenant.stop()


def latency(where: Path, trials: int, seed: int) -> dict[float, list[tuple[float, float]]]:
    results: dict[float, list[tuple[float, float]]] = {1.0: [], 0.2: []}
    rng = random.Random(seed)
    with ExitStack() as stack:
        daemons = {i: stack.enter_context(daemon(where / f"lat-{i}", *watch_flags("kill", i))) for i in results}
        for n in range(trials):
            order = list(daemons.items()) if n % 2 == 0 else list(daemons.items())[::-1]
            for interval, d in order:
                # A trial starts a fixed time after the last kill, i.e. at
                # the same phase of the rounds each time; a random wait of
                # up to one interval spreads it over the whole interval.
                time.sleep(rng.uniform(0, interval))
                results[interval].append(trial(d, where / f"lat-{interval}"))
    return results


def round_wall(port: int) -> tuple[float, int]:
    """Mean wall time of a watchdog round (cgpu_bypass_duration_seconds) and the rounds counted."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("cgpu_bypass_duration_seconds_sum", "cgpu_bypass_duration_seconds_count"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    count = int(values.get("cgpu_bypass_duration_seconds_count", 0))
    return (values["cgpu_bypass_duration_seconds_sum"] / count if count else 0.0), count


def cpu(
    where: Path, rounds: int, seconds: float, instances: int
) -> tuple[dict[float, list[float]], dict[float, tuple[float, int]]]:
    intervals = (0.0, 1.0, 0.2)
    ports = {i: free_port() for i in intervals}
    with ExitStack() as stack:
        daemons = {
            i: stack.enter_context(
                daemon(where / f"cpu-{i}", *watch_flags("report", i), "--metrics-listen", f"127.0.0.1:{ports[i]}")
            )
            for i in intervals
        }
        for i, d in daemons.items():
            for _ in range(instances):
                t = run_tenant(d, "1", neighbour_command(512 * MIB), where / f"cpu-{i}")
                stack.callback(Tenant.stop, t)
        time.sleep(2 * max(intervals))  # every tenant mapped and its memory seen at least once
        for i, d in daemons.items():
            events = bypass_events(d)
            if events:
                raise RuntimeError(f"well-behaved tenants made events at interval {i}: {events}")
        used: dict[float, list[float]] = {i: [] for i in intervals}
        for _ in range(rounds):
            before = {i: _process_cpu(d.proc.pid) for i, d in daemons.items() if d.proc}
            time.sleep(seconds)
            for i, d in daemons.items():
                assert d.proc
                used[i].append(_process_cpu(d.proc.pid) - before[i])
        walls = {i: round_wall(port) for i, port in ports.items()}
    return used, walls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=50, help="latency trials per interval")
    p.add_argument("--rounds", type=int, default=6, help="CPU rounds")
    p.add_argument("--seconds", type=float, default=10.0, help="wall time of one CPU round")
    p.add_argument("--instances", type=int, default=20)
    p.add_argument("--seed", type=int, default=16, help="of the random waits that spread trials over the rounds")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 trials, 2 rounds of 2 s")
    args = p.parse_args()
    if args.quick:
        args.trials, args.rounds, args.seconds = 4, 2, 2.0
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-watchdog-") as d:
        tmp = Path(d)
        try:
            lat = latency(tmp, args.trials, args.seed)
            use, walls = cpu(tmp, args.rounds, args.seconds, args.instances)
        except (RuntimeError, AssertionError, OSError) as e:
            print(f"bench_watchdog: could not measure: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            unmount_regions(tmp)
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"detection latency: {args.trials} trials per interval, interleaved; elf bypass under cgpuctl run "
        "--mem 1, 4 x 1 GiB, kill mode; from the crossing allocation (2nd GiB) to:"
    )
    rows = []
    for interval, pairs in lat.items():
        ev = [e for e, _ in pairs]
        dead = [k for _, k in pairs]
        rows.append(
            (
                f"--bypass-interval {interval:g}",
                f"{statistics.median(ev) * 1e3:.0f}",
                f"{max(ev) * 1e3:.0f}",
                f"{statistics.median(dead) * 1e3:.0f}",
                f"{max(dead) * 1e3:.0f}",
                f"{max(dead) / interval:.2f}",
            )
        )
    print_table(("interval", "event p50 ms", "event max ms", "dead p50 ms", "dead max ms", "max / interval"), rows)
    print()
    print(
        f"cgpud CPU: {args.rounds} rounds of {args.seconds:g} s, {args.instances} instances each with one "
        "process on the GPU; the three daemons side by side"
    )
    base = statistics.median(use[0.0])
    rows = []
    for interval, spent in use.items():
        med = statistics.median(spent)
        per_round = (med - base) / (args.seconds / interval) * 1e3 if interval else 0.0
        wall, count = walls[interval]
        rows.append(
            (
                f"--bypass-interval {interval:g}",
                f"{med * 1e3:.0f}",
                f"{med / args.seconds * 100:.2f}",
                f"{med / base:.2f}" if base else "-",
                f"{(med - base) / args.seconds * 100:+.2f}",
                f"{per_round:.2f}" if interval else "-",
                f"{wall * 1e3:.2f} ({count})" if count else "-",
                " ".join(f"{s * 1e3:.0f}" for s in spent),
            )
        )
    print_table(
        (
            "side",
            "CPU ms / round",
            "% core",
            "ratio to off",
            "watchdog % core",
            "CPU ms per watchdog round",
            "wall ms per watchdog round (n)",
            "each round (ms)",
        ),
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
