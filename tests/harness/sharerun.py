"""Compute-share scenarios on the simulated GPU, measured from the ground
truth: a real cgpud in core_mem mode, tenants started with `cgpuctl run
--core N -- cgpu-burn ...` (libcgpu.so preloaded, saturating, asynchronous
launches over several streams), and each tenant's completed device time
sampled by `cgpu-sim-stat --sample` from the simulation's own per-process
accounting, never from anything the scheduler says about itself. A scenario
can also run natively: the same cgpu-burn processes on the simulated driver
directly, no libcgpu and no `cgpuctl run`, so nothing of cgpud controls
them; `ShareRig.run_rounds` interleaves the two for a side-by-side figure.

Used by bench/bench_compute.py (10 s scenarios, the report) and by
tests/integration/test_compute_shares.py (2-3 s versions, looser bounds)."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from cgpud.cli.client import LocalClient
from cgpud.node.model import ComputePolicy
from cgpud.native import native_path
from tests.harness.sim import write_sim_config
from tests.harness.daemon import BIN, Daemon, make_daemon

SECOND = 1_000_000_000


@dataclass(frozen=True)
class TenantSpec:
    core: int  # requested share in percent; 0: memory-only
    kernel_ns: int = 200_000
    launch_api: str = "kernel"  # kernel | ex | cooperative | graph
    streams: int = 4
    weight: int = 1
    high_priority: bool = False
    delay_s: float = 0.0  # starts this long after the others are running
    burst_ms: float = 0.0  # > 0: bursts of this much queued work, each ended by cuCtxSynchronize ...
    gap_ms: float = 0.0  # ... then this long idle
    sync_every: int = 0  # > 0: synchronise every this many launches
    burst_sync: str = "ctx"  # how a burst's end is waited for: ctx | streams | events | query | none

    def burn_args(self) -> list[str]:
        """cgpu-burn's command line for this tenant (after the program)."""
        args = [
            "--duration",
            "600",
            "--kernel-ns",
            str(self.kernel_ns),
            "--streams",
            str(self.streams),
            "--launch-api",
            self.launch_api,
        ]
        if self.burst_ms:
            args += [
                "--burst-ms",
                f"{self.burst_ms:g}",
                "--gap-ms",
                f"{self.gap_ms:g}",
                "--burst-sync",
                self.burst_sync,
            ]
        if self.sync_every:
            args += ["--sync-every", str(self.sync_every)]
        return args


@dataclass(frozen=True)
class Scenario:
    name: str
    policy: str  # as `cgpuctl policy set` takes it
    tenants: tuple[TenantSpec, ...]
    seconds: float  # measured interval, once every tenant runs
    expected: tuple[float, ...] = ()  # share each tenant should get (default: its core)
    # Switch to this policy 1 s after every tenant runs; `expected` is then
    # what the new policy gives, and the interval starts after the switch.
    then_policy: str | None = None

    def target(self, i: int) -> float:
        return self.expected[i] if self.expected else float(self.tenants[i].core)


@dataclass
class TenantResult:
    spec: TenantSpec
    target: float
    share: float  # percent of wall time over the interval
    windows: list[float]  # percent in each 1 s window

    @property
    def error(self) -> float:
        return abs(self.share - self.target)


@dataclass
class ScenarioResult:
    scenario: Scenario
    tenants: list[TenantResult]
    utilisation: float  # percent of the interval the GPU was busy
    window_errors: list[float] = field(default_factory=list)
    settle_error: float | None = None  # worst tenant error over the first 200 ms after a tenant joins
    settled_error: float | None = None  # the same over the 200 ms after those: is it over by 200 ms?
    daemon_cpu_percent: float = 0.0  # cgpud's CPU time over the interval, % of one core
    scheduler_cpu_percent: float = 0.0  # of that, GPU 0's scheduler thread

    @property
    def mean_error(self) -> float:
        return statistics.fmean(t.error for t in self.tenants)

    @property
    def p95_window_error(self) -> float:
        errs = sorted(self.window_errors)
        return errs[min(len(errs) - 1, int(0.95 * len(errs)))] if errs else 0.0


def _process_cpu(pid: int) -> float:
    """CPU seconds of another process, to the nanosecond: its CPU-time
    clock (clock_getcpuclockid), which Linux lets any process read. The
    /proc tick counts are 10 ms samples, too coarse for a 1 % figure."""
    return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def _scheduler_cpu(pid: int, gpu: int = 0) -> float:
    """CPU seconds of cgpud's scheduler thread for `gpu` (named by engine.c),
    from its schedstat (on-CPU ns; /proc's tick counts are 10 ms samples,
    which a thread at 0.3 % of a core crosses once in 3 s). 0 in a mode that
    runs no scheduler (mps)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        if (task / "comm").read_text().strip() == f"cgpu-sched-{gpu}":
            return int((task / "schedstat").read_text().split()[0]) / 1e9
    return 0.0


class Sampler:
    """`cgpu-sim-stat --sample` read in a thread: (now_ns, gpu busy, per-pid)."""

    def __init__(self, env: dict[str, str], interval_ms: int) -> None:
        self.samples: list[tuple[int, int, dict[int, int]]] = []
        self._proc = subprocess.Popen(
            [str(native_path("bin/cgpu-sim-stat")), "--sample", "0", str(interval_ms), "0"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            s = json.loads(line)
            self.samples.append((s["now_ns"], s["busy_ns"], {int(k): v for k, v in s["per_pid"].items()}))

    def stop(self) -> None:
        self._proc.send_signal(signal.SIGTERM)
        self._proc.wait(timeout=10)
        self._thread.join(timeout=10)


def start_burn_tenant(d: Daemon, mem: str, core: int, *burn: str) -> subprocess.Popen[bytes]:
    """`cgpuctl run --mem MEM --core CORE -- cgpu-burn BURN...` in the
    background: stdout dropped, stderr kept for the message if it fails."""
    return d.start_cgpuctl(
        "run",
        "--mem",
        mem,
        "--core",
        str(core),
        "--",
        str(native_path("bin/cgpu-burn")),
        *burn,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _at(samples: list[tuple[int, int, dict[int, int]]], t: int) -> tuple[int, int, dict[int, int]]:
    """The last sample taken at or before t."""
    best = samples[0]
    for s in samples:
        if s[0] > t:
            break
        best = s
    return best


def _busy(sample: tuple[int, int, dict[int, int]], pid: int) -> int:
    return sample[2].get(pid, 0)


def busy_percent(samples: list[tuple[int, int, dict[int, int]]], pid: int, start_ns: int, end_ns: int) -> float:
    """pid's device time between the samples at start_ns and end_ns, in
    percent of the wall time between them."""
    a, b = _at(samples, start_ns), _at(samples, end_ns)
    return 100.0 * (_busy(b, pid) - _busy(a, pid)) / max(1, b[0] - a[0])


class ShareRig:
    """One simulated GPU and one cgpud in core_mem mode (or the mode
    `daemon_args` give it) for a series of scenarios."""

    def __init__(self, workdir: Path, base_env: dict[str, str], *daemon_args: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = write_sim_config(workdir / "sim.conf", gpus=1, mem="80GiB")
        env = dict(base_env)
        env["LD_LIBRARY_PATH"] = str(native_path("sim"))
        env["CGPU_SIM_CONFIG"] = str(cfg)
        env["CGPU_SIM_STATE"] = str(workdir / "sim.state")
        env["PATH"] = f"{native_path('sim')}:{env.get('PATH', '/usr/bin:/bin')}"  # nvidia-cuda-mps-control (mps mode)
        self.env = env
        # The production sweep interval: the tests' 0.2 s would dominate cgpud's CPU time.
        self.daemon: Daemon = make_daemon(workdir, env, "--mode", "core_mem", "--sweep-interval", "2", *daemon_args)
        self.daemon.start()

    def close(self) -> None:
        self.daemon.stop()

    def _start(self, spec: TenantSpec, native: bool = False) -> subprocess.Popen[bytes]:
        d = self.daemon
        cmd = [str(Path(native_path("bin/cgpu-burn"))), *spec.burn_args()]
        if native:  # the simulator's environment only: no libcgpu, nothing registered with cgpud
            return subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        run = ["run", "--mem", "512MiB", "--core", str(spec.core), "--weight", str(spec.weight)]
        if spec.high_priority:
            run.append("--high-priority")
        return subprocess.Popen(
            [str(BIN / "cgpuctl"), "--socket", str(d.socket), *run, "--", *cmd],
            env=d.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    @staticmethod
    def _burn_pid(run: subprocess.Popen[bytes], deadline: float, native: bool = False) -> int:
        while time.monotonic() < deadline:
            if run.poll() is not None:
                err = run.stderr.read().decode() if run.stderr else ""
                raise AssertionError(f"{'cgpu-burn' if native else 'cgpuctl run'} exited with {run.returncode}: {err}")
            if native:
                return run.pid
            kids = psutil.Process(run.pid).children()
            if kids:
                return kids[0].pid
            time.sleep(0.02)
        raise AssertionError("cgpu-burn did not start under cgpuctl run")

    def run_rounds(
        self, runs: Sequence[tuple[Scenario, bool]], rounds: int, warmup_s: float = 0.5
    ) -> list[list[ScenarioResult]]:
        """Each (scenario, native) `rounds` times, interleaved: every round
        runs them all, starting one further along each time, so neither the
        order nor a drift of the machine's load favours one of them. Returns
        the results per entry of `runs`, in round order."""
        out: list[list[ScenarioResult]] = [[] for _ in runs]
        for r in range(rounds):
            for k in range(len(runs)):
                i = (k + r) % len(runs)
                out[i].append(self.run(runs[i][0], native=runs[i][1], warmup_s=warmup_s))
        return out

    def run(
        self,
        sc: Scenario,
        sample_ms: int = 50,
        warmup_s: float = 0.5,
        window_s: float = 1.0,
        settle_window_s: float = 0.2,
        native: bool = False,
    ) -> ScenarioResult:
        """Starts the tenants without a delay, waits until all of them run,
        then the delayed ones one by one; measures `sc.seconds` from
        `warmup_s` after the last one ran. `native`: the same processes
        without cgpu (the policy and cores are then moot)."""
        assert not (native and sc.then_policy), "a policy switch means nothing natively"
        if any(t.delay_s for t in sc.tenants) or sc.then_policy:
            sample_ms = min(sample_ms, 20)  # the join or switch is timed to a sample
        if not native:
            policy = self.daemon.cgpuctl("policy", "set", sc.policy)
            assert policy.returncode == 0, policy.stderr
        sampler = Sampler(self.env, sample_ms)
        runs: dict[int, subprocess.Popen[bytes]] = {}
        pids: dict[int, int] = {}
        deadline = time.monotonic() + 60
        try:
            first = [i for i, s in enumerate(sc.tenants) if s.delay_s == 0]
            for i in first:
                runs[i] = self._start(sc.tenants[i], native)
            for i in first:
                pids[i] = self._burn_pid(runs[i], deadline, native)
            self._wait_running(sampler, [pids[i] for i in first], deadline)
            start_ns = sampler.samples[-1][0] + int(warmup_s * SECOND)
            joined_ns: int | None = None
            for i, s in enumerate(sc.tenants):
                if s.delay_s == 0:
                    continue
                time.sleep(s.delay_s)
                runs[i] = self._start(s, native)
                pids[i] = self._burn_pid(runs[i], deadline, native)
                self._wait_running(sampler, [pids[i]], deadline)
                joined_ns = self._first_busy(sampler, pids[i])
                start_ns = max(start_ns, joined_ns + int(warmup_s * SECOND))
            if sc.then_policy:
                time.sleep(1.0)
                # Through the API in this process, not cgpuctl, whose own
                # start-up takes longer than the 200 ms being measured; timed
                # from before the request (the simulator's clock is
                # CLOCK_MONOTONIC).
                with LocalClient(self.daemon.socket) as client:
                    joined_ns = time.monotonic_ns()
                    client.set_compute_policy(ComputePolicy[sc.then_policy.upper()])
                start_ns = joined_ns + int(warmup_s * SECOND)
            end_ns = start_ns + int(sc.seconds * SECOND)
            assert self.daemon.proc is not None, "cgpud is not running"
            pid = self.daemon.proc.pid
            while sampler.samples[-1][0] < start_ns:
                time.sleep(sample_ms / 1000)
            cpu0, sched0, t0 = _process_cpu(pid), _scheduler_cpu(pid), time.monotonic()
            while sampler.samples[-1][0] < end_ns + sample_ms * 1_000_000:
                time.sleep(sample_ms / 1000)
            wall = time.monotonic() - t0
            cpu = 100.0 * (_process_cpu(pid) - cpu0) / wall
            sched_cpu = 100.0 * (_scheduler_cpu(pid) - sched0) / wall
        finally:
            for r in runs.values():
                if r.poll() is None:
                    r.send_signal(signal.SIGTERM)
            for r in runs.values():
                try:
                    r.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    r.kill()
            sampler.stop()
        result = self._result(
            sc,
            sampler.samples,
            [pids[i] for i in range(len(sc.tenants))],
            start_ns,
            end_ns,
            window_s,
            joined_ns,
            settle_window_s,
        )
        result.daemon_cpu_percent = cpu
        result.scheduler_cpu_percent = sched_cpu
        return result

    @staticmethod
    def _wait_running(sampler: Sampler, pids: Sequence[int], deadline: float) -> None:
        while time.monotonic() < deadline:
            if sampler.samples and all(_busy(sampler.samples[-1], p) > 0 for p in pids):
                return
            time.sleep(0.01)
        raise AssertionError(f"tenants {list(pids)} never ran on the GPU")

    @staticmethod
    def _first_busy(sampler: Sampler, pid: int) -> int:
        return next(s[0] for s in sampler.samples if _busy(s, pid) > 0)

    @staticmethod
    def _result(
        sc: Scenario,
        samples: list[tuple[int, int, dict[int, int]]],
        pids: list[int],
        start_ns: int,
        end_ns: int,
        window_s: float,
        joined_ns: int | None,
        settle_window_s: float,
    ) -> ScenarioResult:
        a, b = _at(samples, start_ns), _at(samples, end_ns)
        span = b[0] - a[0]
        tenants = []
        window_errors: list[float] = []
        w = int(window_s * SECOND)
        edges = list(range(a[0], b[0] - w + 1, w))
        for i, pid in enumerate(pids):
            share = 100.0 * (_busy(b, pid) - _busy(a, pid)) / span
            windows = []
            for lo in edges:
                s0, s1 = _at(samples, lo), _at(samples, lo + w)
                windows.append(100.0 * (_busy(s1, pid) - _busy(s0, pid)) / max(1, s1[0] - s0[0]))
            target = sc.target(i)
            window_errors += [abs(x - target) for x in windows]
            tenants.append(TenantResult(sc.tenants[i], target, share, windows))
        result = ScenarioResult(sc, tenants, 100.0 * (b[1] - a[1]) / span, window_errors)
        if joined_ns is not None:
            w = int(settle_window_s * SECOND)
            result.settle_error = _settle_error(sc, samples, pids, joined_ns, w)
            result.settled_error = _settle_error(sc, samples, pids, joined_ns + w, w)
        return result


def _settle_error(
    sc: Scenario, samples: list[tuple[int, int, dict[int, int]]], pids: list[int], joined_ns: int, w: int
) -> float:
    """The largest |share - target| of any tenant over w from joined_ns (the
    last tenant's first launch or the policy change, or w after it)."""
    s0, s1 = _at(samples, joined_ns), _at(samples, joined_ns + w)
    dt = max(1, s1[0] - s0[0])
    return max(abs(100.0 * (_busy(s1, p) - _busy(s0, p)) / dt - sc.target(i)) for i, p in enumerate(pids))
