"""cgpud's own CPU with 20 tenants, at the settings users run it with.

Each side is a real cgpud at its defaults but for the mode: `--mode
core_mem`, the default compute policy, bypass interval and sweep interval
(no flag for them), no metrics endpoint. Each runs on its own simulated
80 GiB GPU with 20 tenants started by `cgpuctl run --mem 1 --core 5`
(shares adding to 100 %):

- idle: each tenant holds 512 MiB through libcgpu and launches nothing
  (`cgpu-burn --alloc 512MiB --hold 600`);
- busy: each tenant holds 512 MiB and launches 200 us kernels on 4 streams
  without pause (`cgpu-burn --duration 600`);
- busy-fixed, busy-fair, busy-preemptive: the same under `--compute-policy`
  3, 0 or 1, where the scheduler thread time-slices the GPU (not a
  default; `--scenarios`);
- busy-fixed-windows: `fixed` with `--fixed-windows`, where each tenant
  keeps to its own window and the scheduler thread sleeps (not a default;
  a baseline from before the setting cannot run it);
- busy-fair-windows, busy-preemptive-windows: `fair` or `preemptive` with
  `--busy-windows`, where the tenants, once shown busy, keep to equal
  windows and the scheduler thread sleeps (the same caveats).

Both sides run at the same time, the baseline (`--baseline-venv`: another
build's virtual environment, e.g. main's) with its own cgpud, cgpuctl,
libcgpu and simulated driver. A round reads both cgpud's CPU-time clocks
(exact) and every thread's /proc/PID/task/TID/schedstat (on-CPU ns) over
the same wall time; the table gives medians over the rounds as % of one
core, and the ratio of this side to the baseline. Threads are named by
py-spy (`py-spy dump`, once, after the tenants started) where it is
installed, else by their kernel names.

It is a report: exit 0 whether or not the target (<= 0.5 % of one core)
is met, 1 when it could not measure, 2 on a bad argument. Run from the
repository root:
    .venv/bin/python -m bench.bench_daemon_cpu [--baseline-venv /tmp/base-cpu/.venv] [--rounds 6] [--seconds 10]
        [--tenants 20] [--scenarios idle,busy] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import BenchError, exit_with
from bench.table import print_table
from tests.harness.sharerun import _process_cpu
from tests.harness.sim import write_sim_config
from tests.harness.teardown import terminate

TARGET_PERCENT = 0.5
SCENARIOS = {
    "idle": ((), ("--alloc", "512MiB", "--require-alloc", "--hold", "600")),
    "busy": ((), ("--alloc", "512MiB", "--duration", "600", "--kernel-ns", "200000", "--streams", "4")),
    **{
        f"busy-{policy}": (
            ("--compute-policy", number),
            ("--alloc", "512MiB", "--duration", "600", "--kernel-ns", "200000", "--streams", "4"),
        )
        for policy, number in (("fixed", "3"), ("fair", "0"), ("preemptive", "1"))
    },
    "busy-fixed-windows": (
        ("--compute-policy", "3", "--fixed-windows"),
        ("--alloc", "512MiB", "--duration", "600", "--kernel-ns", "200000", "--streams", "4"),
    ),
    **{
        f"busy-{policy}-windows": (
            ("--compute-policy", number, "--busy-windows"),
            ("--alloc", "512MiB", "--duration", "600", "--kernel-ns", "200000", "--streams", "4"),
        )
        for policy, number in (("fair", "0"), ("preemptive", "1"))
    },
}


@dataclass(frozen=True)
class Build:
    """One side's programs: a virtual environment's cgpud and cgpuctl, and
    the native parts its cgpud package carries."""

    name: str
    bin: Path
    native: Path

    @staticmethod
    def of_venv(name: str, venv: Path) -> Build:
        python = venv / "bin" / "python"
        if not python.exists():
            raise BenchError(f"{venv} has no bin/python")
        out = subprocess.run(
            [str(python), "-c", "from cgpud.native import native_dir; print(native_dir())"],
            capture_output=True,
            text=True,
            cwd="/",
        )
        if out.returncode != 0:
            raise BenchError(f"{venv}'s cgpud has no native parts: {out.stderr.strip()}")
        return Build(name, venv / "bin", Path(out.stdout.strip()))


@dataclass
class Side:
    build: Build
    where: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    socket: Path
    tenants: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid


def machine_env(build: Build, where: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CGPU_REGION_DIR", "NOTIFY_SOCKET")}
    env["LD_LIBRARY_PATH"] = str(build.native / "sim")
    env["CGPU_SIM_CONFIG"] = str(write_sim_config(where / "sim.conf", gpus=1, mem="80GiB"))
    env["CGPU_SIM_STATE"] = str(where / "sim.state")
    env["PATH"] = f"{build.bin}:{build.native / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


@contextmanager
def side(build: Build, where: Path, flags: Sequence[str]) -> Iterator[Side]:
    """cgpud of `build` on a simulated GPU of its own, at its defaults
    but for core_mem and `flags`, once it said READY=1."""
    where.mkdir(parents=True)
    env = machine_env(build, where)
    (where / "none.toml").write_text("")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(where / "notify"))
    sock = where / "run" / "cgpud.sock"
    argv = [
        str(build.bin / "cgpud"),
        "--config",
        str(where / "none.toml"),
        "--state-dir",
        str(where / "state"),
        "--socket",
        str(sock),
        "--relay-socket",
        str(where / "run" / "relay.sock"),
        "--mode",
        "core_mem",
        *flags,
    ]
    with open(where / "cgpud.log", "wb") as log:
        proc = subprocess.Popen(argv, env=dict(env, NOTIFY_SOCKET=str(where / "notify")), stderr=log)
    s = Side(build, where, env, proc, sock)
    try:
        notify.settimeout(60)
        try:
            while b"READY=1" not in notify.recv(4096).split(b"\n"):
                pass
        except TimeoutError as e:
            raise BenchError(f"{build.name}'s cgpud did not start: {(where / 'cgpud.log').read_text()[-2000:]}") from e
        yield s
    finally:
        notify.close()
        stop_tenants(s)
        terminate(proc, timeout=30)
        unmount_regions(where)


def stop_tenants(s: Side) -> None:
    terminate(*s.tenants, timeout=30)  # cgpuctl run passes SIGTERM on and releases the instance


def unmount_regions(under: Path) -> None:
    """Region tmpfs mounts of instances nobody released (cgpud keeps them
    across its stop, as it must across a restart)."""
    from cgpud._region import lib
    from tests.harness.sim import region_mounts

    for point in region_mounts(under):
        lib.cgpu_region_unmount(point.encode())


def start_tenant(s: Side, count: int, burn: Sequence[str]) -> subprocess.Popen[bytes]:
    argv = [
        str(s.build.bin / "cgpuctl"),
        "--socket",
        str(s.socket),
        "run",
        "--mem",
        "1",
        "--core",
        str(100 // count // 5 * 5),
        "--",
        str(s.build.native / "bin" / "cgpu-burn"),
        *burn,
    ]
    with open(s.where / "tenants.log", "ab") as log:
        t = subprocess.Popen(argv, env=s.env, stdout=subprocess.DEVNULL, stderr=log)
    s.tenants.append(t)
    return t


def start_tenants(sides: Sequence[Side], count: int, burn: Sequence[str], timeout: float = 60) -> None:
    """`count` tenants on every side, one at a time on each (40 cgpuctl
    starting at once on 2 vCPUs time out connecting): the next once the
    last one's cgpu-burn runs."""
    for _ in range(count):
        started = [(s, start_tenant(s, count, burn)) for s in sides]
        deadline = time.monotonic() + timeout
        for s, t in started:
            while not any(True for _ in _children(t.pid, "cgpu-burn")):
                if t.poll() is not None:
                    raise BenchError(
                        f"{s.build.name}: a tenant exited with {t.returncode}: "
                        f"{(s.where / 'tenants.log').read_text()[-2000:]}"
                    )
                if time.monotonic() > deadline:
                    raise BenchError(f"{s.build.name}: a tenant's cgpu-burn did not start in {timeout:g} s")
                time.sleep(0.05)


def _children(pid: int, comm: str) -> Iterator[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return
    for k in kids:
        try:
            if Path(f"/proc/{k}/comm").read_text().strip() == comm:
                yield int(k)
        except OSError:
            continue


def thread_clocks(pid: int) -> dict[int, int]:
    """On-CPU ns of every thread of pid (schedstat's first field: exact)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Each thread's name: py-spy's Python thread name and innermost
    function of ours where py-spy can tell, else the kernel's comm."""
    names = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names[int(task.name)] = (task / "comm").read_text().strip()
        except OSError:
            continue
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return names
    out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    tid = None
    for line in out.stdout.splitlines():
        m = re.match(r'Thread (0x[0-9A-Fa-f]+|\d+) \(\w+\): "(.*)"', line)
        if m:
            tid = int(m.group(1), 0)
            if tid not in names:  # py-spy gave the pthread id, not the kernel's
                tid = None
            else:
                names[tid] = m.group(2)
            continue
        m = re.match(r"\s+(\w+) \((?:[^)]*/)?cgpud/([\w/]+)\.py:\d+\)", line)
        if tid is not None and m and "(" not in names[tid]:
            names[tid] += f" ({m.group(2).replace('/', '.')}.{m.group(1)})"
    return names


@dataclass
class Rounds:
    process: list[float] = field(default_factory=list)  # CPU s per round
    threads: dict[int, list[float]] = field(default_factory=dict)  # tid -> CPU s per round


def measure(sides: Sequence[Side], rounds: int, seconds: float) -> dict[str, Rounds]:
    out = {s.build.name: Rounds() for s in sides}
    for n in range(rounds):
        order = list(sides) if n % 2 == 0 else list(sides)[::-1]  # neither always read first
        before = {s.build.name: (_process_cpu(s.pid), thread_clocks(s.pid)) for s in order}
        time.sleep(seconds)
        for s in order:
            cpu0, th0 = before[s.build.name]
            r = out[s.build.name]
            r.process.append(_process_cpu(s.pid) - cpu0)
            for tid, ns in thread_clocks(s.pid).items():
                r.threads.setdefault(tid, []).append((ns - th0.get(tid, 0)) / 1e9)
    return out


def percent(cpu_s: float, seconds: float) -> float:
    return 100.0 * cpu_s / seconds


def run_scenario(
    name: str, builds: Sequence[Build], where: Path, tenants: int, rounds: int, seconds: float, settle: float
) -> tuple[dict[str, Rounds], dict[str, dict[int, str]]]:
    flags, burn = SCENARIOS[name]
    with ExitStack() as stack:
        sides = [stack.enter_context(side(b, where / f"{name}-{b.name}", flags)) for b in builds]
        start_tenants(sides, tenants, burn)
        time.sleep(settle)  # every tenant seen by a few watchdog rounds and sweeps
        names = {s.build.name: thread_names(s.pid) for s in sides}
        result = measure(sides, rounds, seconds)
        for s in sides:
            if any(t.poll() is not None for t in s.tenants):
                raise BenchError(f"{s.build.name}: a tenant exited during the rounds")
    return result, names


def report(name: str, result: dict[str, Rounds], names: dict[str, dict[int, str]], seconds: float) -> list[str]:
    sides = list(result)
    meds = {k: statistics.median(r.process) for k, r in result.items()}
    print(f"\n## {name}")
    head = ["side", "cgpud % core (median)", "CPU ms / round", "each round (ms)"]
    rows = [
        [
            k,
            f"{percent(meds[k], seconds):.3f}",
            f"{meds[k] * 1e3:.1f}",
            " ".join(f"{c * 1e3:.0f}" for c in result[k].process),
        ]
        for k in sides
    ]
    print_table(head, rows)
    if len(sides) == 2 and meds[sides[1]]:
        print(f"ratio {sides[0]} / {sides[1]}: {meds[sides[0]] / meds[sides[1]]:.2f}")
    for k in sides:
        threads = sorted(
            ((statistics.median(v), tid) for tid, v in result[k].threads.items()),
            reverse=True,
        )
        print(f"\n{k}: threads (median % of one core over the rounds; all {len(threads)} threads)")
        print_table(
            ["thread", "tid", "% core"],
            [[names[k].get(tid, "?"), str(tid), f"{percent(cpu, seconds):.3f}"] for cpu, tid in threads if cpu > 0],
        )
    verdicts = []
    for k in sides:
        p = percent(meds[k], seconds)
        verdicts.append(f"{name}: {k} {p:.3f} % of one core: {'met' if p <= TARGET_PERCENT else 'NOT met'}")
    return verdicts


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-venv", type=Path, help="another build's venv, side by side (e.g. main's)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=10.0, help="wall time of one round")
    p.add_argument("--tenants", type=int, default=20)
    p.add_argument("--settle", type=float, default=5.0, help="seconds between the last tenant's start and round 1")
    p.add_argument("--scenarios", default="idle,busy", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--quick", action="store_true", help="2 rounds of 3 s")
    args = p.parse_args(argv)
    chosen = args.scenarios.split(",")
    if any(c not in SCENARIOS for c in chosen) or not 1 <= args.tenants <= 20:
        p.error(f"--scenarios takes {', '.join(SCENARIOS)}; --tenants 1-20")
    if args.quick:
        args.rounds, args.seconds = 2, 3.0
    builds = [Build.of_venv("this", Path(sys.prefix))]
    if args.baseline_venv:
        builds.append(Build.of_venv("base", args.baseline_venv.resolve()))
    print(f"command: {' '.join(sys.argv)}")
    print(
        f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{args.rounds} rounds of {args.seconds:g} s per scenario, {args.tenants} tenants per side, sides measured"
        " over the same wall time"
    )
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-cpu-") as d:
        for name in chosen:
            result, names = run_scenario(name, builds, Path(d), args.tenants, args.rounds, args.seconds, args.settle)
            verdicts += report(name, result, names, args.seconds)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"target: cgpud <= {TARGET_PERCENT} % of one core")
    for v in verdicts:
        print("  " + v)
    return 0


if __name__ == "__main__":
    exit_with("bench_daemon_cpu", main)
