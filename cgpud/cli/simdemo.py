"""`cgpuctl sim demo`: two saturating copies of the portable workload share
one simulated GPU, first bare, then each under a cgpu instance with a memory
limit and a compute share (a private cgpud in core_mem mode, policy fixed).
Shares come from the simulation's own per-process accounting
(`cgpu-sim-stat --sample`), never from cgpu."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from cgpud.cli import simulator
from cgpud.cli.client import LocalClient
from cgpud.errors import CgpuError
from cgpud.native import native_path
from cgpud.units import GIB

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Tenant:
    label: str
    memory_gib: int
    core: int
    streams: int

    def burn(self, seconds: float, until_fail: bool) -> list[str]:
        alloc = ["--alloc-until-fail", "1GiB"] if until_fail else [f"--alloc={self.memory_gib}GiB"]
        return [
            str(native_path("bin/cgpu-burn")),
            *alloc,
            "--kernel-ns=1000000",
            "--duty=1",
            f"--streams={self.streams}",
            f"--duration={seconds}",
        ]


TENANTS = (Tenant("A", 24, 30, 4), Tenant("B", 8, 70, 1))


@dataclass
class Outcome:
    share: float  # percent of GPU 0's wall time
    granted_gib: float


def _env(files: simulator.SimFiles) -> dict[str, str]:
    env = dict(os.environ)
    lib = native_path("sim/libcuda.so.1").parent
    env["LD_LIBRARY_PATH"] = f"{lib}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(lib)
    env["CGPU_SIM_CONFIG"] = str(files.config)
    env["CGPU_SIM_STATE"] = str(files.state)
    # The demo's cgpud is no service: it must not report to a service
    # manager the demo itself may run under; readiness is polled instead.
    env.pop("NOTIFY_SOCKET", None)
    return env


def run(machine: simulator.SimMachine, seconds: float) -> int:
    if not 0.5 <= seconds <= 600:
        raise CgpuError("--seconds must be between 0.5 and 600")
    if machine.memory < 40 * GIB:
        # 32 GiB for the two tenants, and room beyond A's 24 GiB limit so that
        # the limit, not the GPU running out, is what stops A.
        raise CgpuError("the demo's tenants hold 32 GiB and A tries for more: use --mem 40GiB or more")
    shared = simulator.write_config(machine)
    # A private state: the demo neither disturbs nor is disturbed by other
    # programs using the same simulated machine.
    files = simulator.SimFiles(shared.config, shared.state.with_name(f"{shared.state.stem}-demo-{os.getpid()}.state"))
    env = _env(files)
    try:
        print(f"Simulated machine: {machine.gpus} x {machine.name}, {machine.memory / GIB:g} GiB each")
        print(f"Two saturating workloads (1 ms kernels) share GPU 0 for {seconds:g} s each time.\n")
        print("Without cgpu: the driver's time slicing decides.")
        bare = _measure(
            env,
            [
                lambda t=t: subprocess.Popen(t.burn(seconds, False), env=env, stdout=subprocess.PIPE, text=True)
                for t in TENANTS
            ],
            direct=True,
        )
        for t, o in zip(TENANTS, bare):
            label = f"tenant {t.label} ({t.streams} stream{'s' if t.streams > 1 else ''}):"
            print(f"  {label:21} {o.granted_gib:4.0f} GiB, {o.share:5.1f} % of GPU 0")
        print("\nWith cgpu: cgpud in core_mem mode, compute policy fixed; each tenant under cgpuctl run.")
        with tempfile.TemporaryDirectory(prefix="cgpu-demo-") as tmp:
            limited = _with_cgpud(env, Path(tmp), seconds)
        for t, o in zip(TENANTS, limited):
            print(
                f"  tenant {t.label}: cgpuctl run --mem {t.memory_gib}GiB --core {t.core}: "
                f"{o.granted_gib:4.0f} GiB, {o.share:5.1f} % of GPU 0"
            )
        a, b = TENANTS
        print(
            f"\nWithout cgpu: A got {bare[0].share:.1f} %, B got {bare[1].share:.1f} % "
            f"({a.streams} streams against {b.streams}; there is nothing to ask for)."
        )
        print(
            f"With cgpu:    A asked {a.core} %, got {limited[0].share:.1f} %; "
            f"B asked {b.core} %, got {limited[1].share:.1f} %; "
            f"A asked {a.memory_gib} GiB, got {limited[0].granted_gib:.0f} GiB (allocating until refused)."
        )
        return 0
    finally:
        simulator.reset(files.state)


def _with_cgpud(env: dict[str, str], tmp: Path, seconds: float) -> list[Outcome]:
    sock = tmp / "cgpud.sock"
    (tmp / "config.toml").write_text("")
    # A file, not a pipe: nobody reads a pipe while the demo runs.
    with open(tmp / "cgpud.log", "w") as log:
        daemon = subprocess.Popen(
            [
                str(BIN / "cgpud"),
                "--state-dir",
                str(tmp / "state"),
                "--socket",
                str(sock),
                "--relay-socket",
                str(tmp / "relay.sock"),
                "--config",
                str(tmp / "config.toml"),
                "--mode",
                "core_mem",
                "--compute-policy",
                "3",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        _wait_ready(daemon, sock, tmp / "cgpud.log")
        ctl = [str(BIN / "cgpuctl"), "--socket", str(sock), "run"]
        starts = [
            lambda t=t: subprocess.Popen(
                [*ctl, "--mem", f"{t.memory_gib}GiB", "--core", str(t.core), "--", *t.burn(seconds, t.label == "A")],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for t in TENANTS
        ]
        return _measure(env, starts, direct=False)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def _wait_ready(daemon: subprocess.Popen[bytes], sock: Path, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            break
        try:
            with LocalClient(sock, timeout=1) as client:
                client.node_info()
                return
        except CgpuError:
            time.sleep(0.1)
    tail = log.read_text()[-2000:] if log.exists() else ""
    raise CgpuError(f"the demo's cgpud did not come up; its log ends:\n{tail}")


def _measure(env: dict[str, str], starts: list, direct: bool) -> list[Outcome]:
    """Runs the workloads side by side; each one's device time over the
    span in which both ran, from the simulator's own accounting."""
    sampler = subprocess.Popen(
        [str(native_path("bin/cgpu-sim-stat")), "--sample", "0", "50", "0"], env=env, stdout=subprocess.PIPE, text=True
    )
    procs = [start() for start in starts]
    try:
        pids = [p.pid if direct else _child(p) for p in procs]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sampler.send_signal(signal.SIGTERM)
        lines = sampler.communicate(timeout=30)[0].splitlines()
    if any(p.returncode != 0 for p in procs):
        raise CgpuError('a workload failed; run cgpu-burn by hand after `eval "$(cgpuctl sim env)"` to see why')
    samples = [json.loads(line) for line in lines]
    both = [s for s in samples if all(s["per_pid"].get(str(pid), 0) > 0 for pid in pids)]
    if len(both) < 2:
        raise CgpuError("the workloads never ran together on GPU 0; try a longer --seconds")
    # From the first sample where both ran to the last before either stopped.
    ends = [max(s["now_ns"] for s in samples if s["per_pid"].get(str(pid), 0) < _final(samples, pid)) for pid in pids]
    first = both[0]
    last = max((s for s in samples if s["now_ns"] <= min(ends)), key=lambda s: s["now_ns"])
    span = max(1, last["now_ns"] - first["now_ns"])
    results = [json.loads(o) for o in outputs]
    return [
        Outcome(100.0 * (last["per_pid"][str(pid)] - first["per_pid"][str(pid)]) / span, _granted(r) / GIB)
        for pid, r in zip(pids, results)
    ]


def _granted(report: dict) -> int:
    a = report["alloc"]
    return a["granted_bytes"] + a["until_fail_chunk"] * a["until_fail_count"]


def _final(samples: list[dict], pid: int) -> int:
    return max(s["per_pid"].get(str(pid), 0) for s in samples)


def _child(run: subprocess.Popen[str]) -> int:
    """The workload `cgpuctl run` started: the process on the GPU."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise CgpuError(f"cgpuctl run exited with {run.returncode} before its workload started")
        kids = psutil.Process(run.pid).children()
        if kids:
            return kids[0].pid
        time.sleep(0.02)
    raise CgpuError("cgpuctl run did not start its workload")
