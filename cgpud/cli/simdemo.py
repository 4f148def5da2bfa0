"""`cgpuctl sim demo`: two copies of the portable workload share one
simulated GPU; the report shows what each did and, from the simulation's own
accounting, how the device was shared. Without cgpu's isolation (later
issues) both get whatever the driver's time slicing gives them."""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgpud.cli import simulator
from cgpud.errors import CgpuError
from cgpud.native import native_path

GIB = 1 << 30


@dataclass(frozen=True)
class Tenant:
    label: str
    memory_gib: int
    duty: float
    kernel_ms: float

    def command(self, burn: Path, seconds: float) -> list[str]:
        return [
            str(burn),
            f"--alloc={self.memory_gib}GiB",
            f"--kernel-ns={int(self.kernel_ms * 1e6)}",
            f"--duration={seconds}",
            f"--duty={self.duty}",
            "--events",
        ]


TENANTS = (Tenant("A", 24, 1.0, 1.0), Tenant("B", 8, 0.5, 1.0))


def _env(files: simulator.SimFiles) -> dict[str, str]:
    env = dict(os.environ)
    lib = native_path("sim/libcuda.so.1").parent
    env["LD_LIBRARY_PATH"] = f"{lib}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(lib)
    env["CGPU_SIM_CONFIG"] = str(files.config)
    env["CGPU_SIM_STATE"] = str(files.state)
    return env


def _stat(env: dict[str, str], *args: str) -> Any:
    proc = subprocess.run(
        [str(native_path("bin/cgpu-sim-stat")), *args], env=env, capture_output=True, text=True, timeout=30
    )
    if proc.returncode != 0:
        raise CgpuError(f"reading the simulated GPU state failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def run(machine: simulator.SimMachine, seconds: float) -> int:
    if not 0.5 <= seconds <= 600:
        raise CgpuError("--seconds must be between 0.5 and 600")
    if machine.memory < 32 * GIB:
        raise CgpuError("the demo's tenants hold 32 GiB together: use --mem 32GiB or more")
    shared = simulator.write_config(machine)
    # A private state: the demo neither disturbs nor is disturbed by other
    # programs using the same simulated machine.
    files = simulator.SimFiles(shared.config, shared.state.with_name(f"{shared.state.stem}-demo-{os.getpid()}.state"))
    try:
        return _run_tenants(machine, files, seconds)
    finally:
        simulator.reset(files.state)


def _run_tenants(machine: simulator.SimMachine, files: simulator.SimFiles, seconds: float) -> int:
    env = _env(files)
    burn = native_path("bin/cgpu-burn")
    print(f"Simulated machine: {machine.gpus} x {machine.name}, {machine.memory / GIB:g} GiB each")
    print(f"Two workloads share GPU 0 for {seconds:g} s, with no isolation yet:")
    for t in TENANTS:
        print(f"  tenant {t.label}: {t.memory_gib} GiB, {t.kernel_ms:g} ms kernels at {t.duty:.0%} duty")

    start_ns = _stat(env)["now_ns"]
    procs = [subprocess.Popen(t.command(burn, seconds), env=env, stdout=subprocess.PIPE, text=True) for t in TENANTS]
    time.sleep(min(seconds / 2, 1.0))
    during = _stat(env)
    outputs = [p.communicate(timeout=seconds + 60)[0] for p in procs]
    end_ns = _stat(env)["now_ns"]
    if any(p.returncode != 0 for p in procs):
        raise CgpuError("a workload failed; run cgpu-burn by hand after `eval \"$(cgpuctl sim env)\"` to see why")
    busy = _stat(env, "--busy", "0", str(start_ns), str(end_ns))
    _report(procs, [json.loads(o) for o in outputs], during, busy, end_ns - start_ns)
    return 0


def _report(procs: list[subprocess.Popen[str]], results: list[dict[str, Any]], during: dict[str, Any],
            busy: dict[str, Any], span_ns: int) -> None:
    print(f"\n{'tenant':<8}{'memory':>10}{'launches':>10}{'device time':>13}{'GPU 0 share':>13}")
    for tenant, proc, res in zip(TENANTS, procs, results):
        share = busy["per_pid"].get(str(proc.pid), 0) / span_ns
        granted = res["alloc"]["granted_bytes"] / GIB
        device_s = res["launches"] * tenant.kernel_ms / 1000
        print(f"{tenant.label:<8}{granted:>7.0f} GiB{res['launches']:>10}{device_s:>11.2f} s{share:>12.0%}")
    gpu0 = during["gpus"][0]
    print(
        f"\nGPU 0: busy {busy['busy_ns'] / span_ns:.0%} of {span_ns / 1e9:.2f} s; "
        f"memory {gpu0['used'] / GIB:.0f} of {gpu0['total'] / GIB:.0f} GiB in use while both ran"
    )
