"""What the bypass watchdog's end-to-end tests and bench/bench_watchdog.py
share: tenants as real processes whose JSON lines are read as they come,
the host's NVML view through one long-lived pynvml process (what the
simulated driver reports, as `nvidia-smi` would), and cgpud's bypass
events as `cgpuctl events --output json` gives them.

Times are CLOCK_REALTIME seconds on both sides: the tenants stamp each
allocation with it and cgpud stamps each event with it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from cgpud.cli.client import LocalClient
from cgpud.node.model import Instance
from cgpud.native import native_path
from tests.harness.daemon import BIN, Daemon
from tests.harness.wait import until

GIB = 1 << 30
MIB = 1 << 20
INTERVAL = 0.2  # the tests' watchdog interval: 5 rounds a second
SLACK = 512 * MIB  # the default bypass_memory_slack_mib, per process


def watch_flags(action: str = "report", interval: float = INTERVAL, *extra: str) -> list[str]:
    return ["--bypass-interval", str(interval), "--bypass-action", action, *extra]


class Lines:
    """A pipe of lines read in a thread; the JSON ones parsed, the others kept."""

    def __init__(self, stream: Any) -> None:
        self.json: list[dict[str, Any]] = []
        self.text: list[str] = []
        self._cond = threading.Condition()
        self._stream = stream
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stream:
            with self._cond:
                self.text.append(line)
                if line.startswith("{"):
                    try:
                        self.json.append(json.loads(line))
                    except ValueError:
                        pass
                self._cond.notify_all()
        with self._cond:
            self.text.append("")  # end of stream
            self._cond.notify_all()

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str = "a line") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for obj in self.json:
                    if pred(obj):
                        return obj
                left = deadline - time.monotonic()
                if left <= 0 or (self.text and self.text[-1] == ""):
                    raise AssertionError(f"no {what} within {timeout} s; output: {''.join(self.text)[-2000:]}")
                self._cond.wait(left)


@dataclass
class Tenant:
    """A process under test: `cgpuctl run` (then `pid` is the workload, the
    child of cgpuctl) or a plain process (then `pid` is `proc.pid`)."""

    proc: subprocess.Popen[str]
    out: Lines
    pid: int
    instance_id: str = ""
    stderr: Path | None = None

    def crossing(self, limit: int, slack: int = SLACK, timeout: float = 30) -> float:
        """CLOCK_REALTIME of the allocation that took the tenant past its
        limit plus the slack of one process."""
        line = self.out.wait(
            lambda o: o.get("event") == "allocated" and o["total_bytes"] > limit + slack,
            timeout,
            f"an allocation past {(limit + slack) / MIB:.0f} MiB",
        )
        return float(line["time"])

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            for pid in {self.pid, self.proc.pid}:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=30)

    def errors(self) -> str:
        return self.stderr.read_text()[-2000:] if self.stderr and self.stderr.exists() else ""


def _spawn(argv: Sequence[str], env: dict[str, str], stderr: Path) -> subprocess.Popen[str]:
    with open(stderr, "w") as err:
        return subprocess.Popen(
            list(argv), env=env, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True
        )


def instance_of(daemon: Daemon, cgpuctl_pid: int, timeout: float = 30) -> Instance:
    """The instance `cgpuctl run` (pid) made, once it bound its child;
    released ones too (in kill mode a tenant may be gone before we look)."""
    with LocalClient(daemon.socket) as client:

        def bound() -> Instance | None:
            for inst in client.list(include_released=True):
                if inst.owner.id.endswith(f"-{cgpuctl_pid}") and len(inst.pids) == 2:
                    return inst
            return None

        return until(bound, timeout=timeout, interval=0.02, what=f"a bound instance of cgpuctl run {cgpuctl_pid}")


def run_tenant(daemon: Daemon, mem: str, command: Sequence[str], where: Path, core: int = 0) -> Tenant:
    """`cgpuctl run --mem <mem> [--core N] -- command`, its instance and child."""
    extra = ["--core", str(core)] if core else []
    stderr = where / f"tenant-{len(list(where.glob('tenant-*')))}.err"
    proc = _spawn(
        [str(BIN / "cgpuctl"), "--socket", str(daemon.socket), "run", "--mem", mem, *extra, "--", *command],
        daemon.env,
        stderr,
    )
    try:
        inst = instance_of(daemon, proc.pid)
    except AssertionError:
        proc.kill()
        proc.wait()
        raise AssertionError(f"cgpuctl run failed: {stderr.read_text()}") from None
    child = next(p for p in inst.pids if p != proc.pid)
    return Tenant(proc, Lines(proc.stdout), child, inst.id, stderr)


def run_plain(env: dict[str, str], command: Sequence[str], where: Path) -> Tenant:
    """A process with no instance at all: what an unknown GPU user is."""
    stderr = where / f"plain-{len(list(where.glob('plain-*')))}.err"
    proc = _spawn(command, env, stderr)
    return Tenant(proc, Lines(proc.stdout), proc.pid, "", stderr)


def neighbour_command(total: int) -> list[str]:
    """A well-behaved tenant through libcgpu: allocates right up to its
    limit and holds it."""
    return [str(native_path("bin/cgpu-burn")), "--alloc", f"{total // MIB}MiB", "--require-alloc", "--hold", "600"]


def bypass_command(kind: str, *args: str, hold: int = 600) -> list[str]:
    """A tenant of tests/harness/bypass_build.py allocating 4 x 1 GiB and holding it
    `hold` seconds, as a command for `cgpuctl run` (the musl one has LD_PRELOAD
    removed: its loader would try the glibc-built libcgpu and fail to start,
    so dropping the variable is what such a tenant does)."""
    from tests.harness import bypass_build

    alloc = ["--alloc-mib", "1024", "--count", "4", "--hold", str(hold), *args]
    if kind == "elf":
        return [str(bypass_build.elf_bypass()), "--resolve", "elf", *alloc]
    if kind == "static":
        return [str(bypass_build.static_bypass()), "--resolve", "link", *alloc]
    if kind == "musl":
        return [
            "env",
            "-u",
            "LD_PRELOAD",
            *bypass_build.musl_host_env(),
            str(bypass_build.musl_bypass()),
            "--resolve",
            "link",
            *alloc,
        ]
    raise ValueError(kind)


def wait_dead(pid: int, timeout: float) -> float | None:
    """CLOCK_REALTIME when `pid` exited (pidfd readable), None if it did not
    within `timeout` (None too if it was gone before the call)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return time.time()
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return time.time() if ready else None
    finally:
        os.close(fd)


NVML_PROBE = """
import json, sys, pynvml as n
n.nvmlInit()
h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
def samples(d):
    # pynvml sizes the array in one call and fills it in the next; a sample
    # taken in between makes the second INSUFFICIENT_SIZE, as on a real driver.
    for attempt in range(20):
        try:
            got = n.nvmlDeviceGetProcessUtilization(d, 0)
            break
        except n.NVMLError_NotFound:
            return {}
        except n.NVMLError_InsufficientSize:
            if attempt == 19:
                raise
    best = {}
    for s in got:
        best[str(s.pid)] = max(best.get(str(s.pid), 0), s.smUtil)
    return best
for _ in sys.stdin:
    out = []
    for d in h:
        procs = {str(p.pid): p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(d)}
        out.append({"used": n.nvmlDeviceGetMemoryInfo(d).used, "procs": procs, "sm": samples(d)})
    print(json.dumps(out), flush=True)
"""


class Nvml:
    """The host's NVML view, one query per call, from one pynvml process."""

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", NVML_PROBE],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def query(self, gpu: int = 0) -> dict[str, Any]:
        assert self._proc.stdin and self._proc.stdout
        self._proc.stdin.write("\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, f"the NVML probe died: {self._proc.stderr.read() if self._proc.stderr else ''}"
        view = json.loads(line)[gpu]
        return {
            "used": view["used"],
            "procs": {int(k): v for k, v in view["procs"].items()},
            "sm": {int(k): v for k, v in view["sm"].items()},
        }  # highest smUtil of each pid's samples

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        view: dict[str, Any] = {}

        def shown() -> dict[str, Any] | None:
            nonlocal view
            view = self.query()
            return view if pred(view) else None

        return until(
            shown, timeout=timeout, interval=0.02, what=f"NVML to show {what}", explain=lambda: f"last view: {view}"
        )

    def close(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        self._proc.wait(timeout=10)


def bypass_listing(daemon: Daemon) -> dict[str, Any]:
    """`cgpuctl events --output json`: whether the watchdog looks (and why
    not), and every event cgpud holds, oldest first."""
    got = daemon.cgpuctl("events", "--output", "json", "--limit", "1000")
    assert got.returncode == 0, got.stderr
    return dict(json.loads(got.stdout))


def bypass_events(daemon: Daemon) -> list[dict[str, Any]]:
    """Each event as cgpuctl gives it: time (Unix seconds, the round's),
    kind, instance_id, gpu, pids, used_bytes, limit_bytes, measured_percent,
    allowed_percent, action, killed, detail, action_detail."""
    return list(bypass_listing(daemon)["events"])


def violations(daemon: Daemon) -> dict[str, int]:
    """The VIOLATIONS column of `cgpuctl list`, by instance (released ones too)."""
    got = daemon.cgpuctl("list", "--all", "--output", "json")
    assert got.returncode == 0, got.stderr
    return {i["id"]: i["violations"] for i in json.loads(got.stdout)}


def wait_events(
    daemon: Daemon, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def found() -> list[dict[str, Any]]:
        nonlocal events
        events = bypass_events(daemon)
        return [e for e in events if pred(e)]

    return until(
        found,
        timeout=timeout,
        interval=0.05,
        what=what,
        explain=lambda: f"events: {events}; cgpud's log ends: {daemon.log.read_text()[-3000:]}",
    )


@dataclass
class Watched:
    """A tenant next to a neighbour on one cgpud: what the tests assert on."""

    tenant: Tenant
    neighbour: Tenant
    baseline_used: int  # NVML's used memory with the neighbour alone
    crossed: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
