"""The hole the bypass watchdog closes: tenants under `cgpuctl run --mem 1`
that go around libcgpu.so get 4 GiB of a 16 GiB GPU, while a tenant that
asks the driver by name (dlsym, as the CUDA runtime does) is held to 1 GiB.

The tenants (tests/harness/bypass_build.py): cgpu-bypass finding the driver's entry
points in its ELF symbol table (the preload is in the process, unused); the
same linked statically with the simulated driver inside (no ld.so, so no
preload: the stand-in for a program that drives the device files); built for
musl (its loader cannot load the glibc-built libcgpu, so the tenant drops
LD_PRELOAD). Dropping LD_PRELOAD is itself a bypass: cgpu-burn does it here.

None of this is the watchdog's business to prevent: these tests pin down
what escapes, so that tests/integration/test_bypass_watchdog.py shows each
escape found. The GPU is read through the simulator (cgpu-sim-stat)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cgpud.native import native_path
from tests.harness import bypass_build
from tests.harness.bypass_watch import bypass_command
from tests.harness.sim import write_sim_config
from tests.harness.daemon import BIN, Daemon, running_daemon
from tests.harness.simrun import sim_stat

GIB = 1 << 30
GPU_MEM = 16 * GIB
ALLOC = ["--alloc-mib", "1024", "--count", "4"]


@dataclass
class Tenant:
    """`cgpuctl run --mem 1 -- command`, its stdout read line by line."""

    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def until(self, event: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not line:
                break
            if line.startswith("{"):
                self.seen.append(json.loads(line))
                if self.seen[-1].get("event") == event:
                    return self.seen[-1]
        stderr = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        raise AssertionError(f"no {event!r} line from the tenant; got {self.seen}, exit {self.proc.poll()}, {stderr}")


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Iterator[tuple[Daemon, dict[str, str]]]:
    """One cgpud for the module (tenants run one at a time and leave the GPUs
    empty), its watchdog off: what libcgpu alone lets through; 2 simulated
    GPUs of 16 GiB."""
    tmp = tmp_path_factory.mktemp("bypass")
    env = dict(
        os.environ,
        LD_LIBRARY_PATH=str(native / "sim"),
        CGPU_SIM_STATE=str(tmp / "sim.state"),
        CGPU_SIM_CONFIG=str(write_sim_config(tmp / "sim.conf")),
    )
    with running_daemon(tmp, env, "--bypass-interval", "0") as d:
        yield d, env


@contextmanager
def tenant(d: Daemon, command: list[str]) -> Iterator[Tenant]:
    proc = subprocess.Popen(
        [str(BIN / "cgpuctl"), "--socket", str(d.socket), "run", "--mem", "1", "--", *command],
        env=d.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield Tenant(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def instance_of(d: Daemon, pid: int) -> dict[str, Any]:
    listed = json.loads(d.cgpuctl("list", "--output", "json").stdout)
    [inst] = [i for i in listed if pid in i["pids"]]
    return inst


@pytest.mark.parametrize("kind", ["elf", "static", "musl"])
def test_bypass_tenant_holds_4gib_in_a_1gib_instance(
    machine: tuple[Daemon, dict[str, str]], native: Path, kind: str
) -> None:
    d, env = machine
    with tenant(d, bypass_command(kind, hold=60)) as t:
        ready = t.until("ready")
        held = t.until("holding")
        pid = ready["pid"]
        inst = instance_of(d, pid)  # bound to the instance: the watchdog can name it
        [grant] = inst["grants"]
        assert grant["memory_bytes"] == GIB
        # The driver's own view, not the limit libcgpu would show.
        assert ready["mem_total"] == GPU_MEM
        assert [e["total_bytes"] for e in t.seen if e["event"] == "allocated"] == [GIB, 2 * GIB, 3 * GIB, 4 * GIB]
        assert held["total_bytes"] == 4 * GIB
        stat = sim_stat(native, env)
        [proc] = [p for p in stat["procs"] if p["pid"] == pid and p["alive"]]
        assert proc["used"][grant["gpu"]] == 4 * GIB
        assert stat["gpus"][grant["gpu"]]["used"] == 4 * GIB
        maps = Path(f"/proc/{pid}/maps").read_text()
        # ELF walk: libcgpu is loaded and never consulted. Static: no loader
        # ran to load it. musl: the variable that would was dropped.
        assert ("libcgpu.so" in maps) == (kind == "elf"), maps
        t.proc.send_signal(signal.SIGTERM)  # cgpuctl passes it on; the tenant frees and reports
        summary = t.until("summary")
        assert t.proc.wait(timeout=30) == 0
    assert summary["allocated"] == 4 and summary["refused"] is None and summary["errors"] == 0
    assert sim_stat(native, env)["gpus"][grant["gpu"]]["used"] == 0


def burn(d: Daemon, *prefix: str) -> dict[str, Any]:
    proc = d.cgpuctl(
        "run",
        "--mem",
        "1",
        "--",
        *prefix,
        str(native_path("bin/cgpu-burn")),
        "--resolve",
        "dlsym",
        *[a for _ in range(4) for a in ("--alloc", "1GiB")],
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_dlsym_control_tenant_is_held_to_1gib(machine: tuple[Daemon, dict[str, str]]) -> None:
    """What the bypasses are measured against: through dlsym, libcgpu answers."""
    report = burn(machine[0])
    assert report["alloc"]["results"] == ["CUDA_SUCCESS"] + ["CUDA_ERROR_OUT_OF_MEMORY"] * 3
    assert report["alloc"]["granted_bytes"] == GIB
    assert report["mem_total_reported"] == GIB


def test_dropping_ld_preload_escapes_the_limit(machine: tuple[Daemon, dict[str, str]]) -> None:
    """LD_PRELOAD is only an environment variable of a host tenant."""
    report = burn(machine[0], "env", "-u", "LD_PRELOAD")
    assert report["alloc"]["results"] == ["CUDA_SUCCESS"] * 4
    assert report["alloc"]["granted_bytes"] == 4 * GIB
    assert report["mem_total_reported"] == GPU_MEM


def test_musl_tenant_with_the_preload_kept_cannot_start(machine: tuple[Daemon, dict[str, str]]) -> None:
    """Why the musl tenant drops LD_PRELOAD: musl's loader honours it and then
    fails on the glibc-built libcgpu (a usability limit, not a bypass)."""
    d, _ = machine
    proc = d.cgpuctl(
        "run",
        "--mem",
        "1",
        "--",
        "env",
        *bypass_build.musl_host_env(),
        str(bypass_build.musl_bypass()),
        *ALLOC,
        timeout=60,
    )
    assert proc.returncode == 127, (proc.returncode, proc.stdout, proc.stderr)
    assert "libcgpu.so" in proc.stderr and '"allocated"' not in proc.stdout


def test_bypass_tool_exit_codes_and_refusal(sim_env: dict[str, str]) -> None:
    """The documented exit codes, with no cgpud: a driver refusal ends the
    allocations (exit 3), a resolver this build lacks is a setup error (2)."""
    tool = str(bypass_build.elf_bypass())
    proc = subprocess.run(
        [tool, "--resolve", "elf", "--alloc-mib", "4096", "--count", "5"],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 3, proc.stderr
    events = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [e["event"] for e in events] == ["ready"] + ["allocated"] * 4 + ["refused", "holding", "summary"]
    assert events[5]["result"] == "CUDA_ERROR_OUT_OF_MEMORY" and events[5]["total_bytes"] == GPU_MEM
    assert events[-1]["allocated"] == 4 and events[-1]["refused"] == "CUDA_ERROR_OUT_OF_MEMORY"
    for args in (["--resolve", "link"], ["--count", "0"], ["--alloc-mib", "1.5"], ["extra"]):
        bad = subprocess.run([tool, *args], env=sim_env, capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("cgpu-bypass: "), (args, bad)
    assert subprocess.run([tool, "--help"], capture_output=True, timeout=30).returncode == 0
