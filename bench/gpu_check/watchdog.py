"""Bypass watchdog on the machine's NVML: a tenant that allocates around
libcgpu (cgpu-bypass walks libcuda's symbol table) past its limit is found in
NVML's process list and killed; a GPU process of no instance is reported; a
tenant whose kernels skip libcgpu's gate (LD_PRELOAD removed) is found over
its fixed share in NVML's per-process utilisation and killed."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from bench.gpu_check.model import CheckError, CheckResult
from bench.gpu_check.rig import Cgpud, Rig, kill_group
from bench.gpu_check.runner import Runner, verdict

GROUP = "watchdog"
INTERVAL = 0.5
WINDOW = 2.0


def events(d: Cgpud) -> list[dict[str, Any]]:
    out = d.cgpuctl("events", "--output", "json", "--limit", "1000").stdout
    try:
        return list(json.loads(out)["events"])
    except (ValueError, KeyError) as e:
        raise CheckError(f"cgpuctl events printed {out[:200]!r}: {e}") from e


def watch(
    rig: Rig, d: Cgpud, argv: Sequence[str], kind: str, timeout: float, wants: Callable[[dict[str, Any]], bool]
) -> tuple[dict[str, Any], float, subprocess.Popen[str]]:
    """Starts `argv` and waits for an event of `kind`; the event, the seconds
    from the start and the process (still to be reaped)."""
    before = len(events(d))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        env=rig.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        while time.monotonic() - t0 < timeout:
            for e in events(d)[before:]:
                if e.get("kind") == kind and wants(e):
                    return e, time.monotonic() - t0, proc
            if proc.poll() is not None and kind != "unknown_process" and proc.returncode not in (-9, 137):
                _, err = proc.communicate()
                raise CheckError(f"{argv[-1]} ended ({proc.returncode}) before any {kind} event: {err.strip()[-200:]}")
            time.sleep(0.1)
    except BaseException:
        kill_group(proc)
        proc.wait()
        raise
    kill_group(proc)
    proc.wait()
    raise CheckError(f"no {kind} event within {timeout:.0f} s")


def finish(proc: subprocess.Popen[str], timeout: float) -> bool:
    """Whether `proc` ended by itself (cgpuctl run exits when its child is killed)."""
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        return False


def memory_bypass(rig: Rig, d: Cgpud) -> CheckResult:
    argv = d.run_argv(
        f"{rig.options.mem_gib}GiB",
        str(rig.tools.bypass),
        "--alloc-mib",
        "1024",
        "--count",
        str(rig.options.mem_gib + 2),
        "--hold",
        "60",
    )
    event, after, proc = watch(rig, d, argv, "memory_over_limit", 20, lambda e: bool(e.get("instance_id")))
    ended = finish(proc, 10)
    ok = event.get("action") == "killed" and ended
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"found and {event.get('action')} {after:.1f} s after start",
        expected="memory_over_limit, killed",
        detail="" if ok else f"event {event}, tenant ended: {ended}",
        values={"event": event, "seconds_from_start": after, "tenant_ended": ended},
    )


def unknown_process(rig: Rig, d: Cgpud) -> CheckResult:
    argv = [str(rig.tools.burn), "--alloc", "256MiB", "--hold", "30"]
    event, after, proc = watch(rig, d, argv, "unknown_process", 15, lambda e: not e.get("instance_id"))
    alive = proc.poll() is None
    kill_group(proc)
    proc.wait()
    ok = event.get("action") == "reported" and alive
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"reported {after:.1f} s after start",
        expected="unknown_process, reported, left running",
        detail="" if ok else f"event {event}, still running: {alive}",
        values={"event": event, "seconds_from_start": after},
    )


def compute_bypass(rig: Rig, d: Cgpud) -> CheckResult:
    argv = d.run_argv(
        f"{rig.options.mem_gib}GiB",
        "env",
        "-u",
        "LD_PRELOAD",
        str(rig.tools.burn),
        "--duration",
        "60",
        "--kernel-ns",
        "1000000",
        core=20,
    )
    event, after, proc = watch(rig, d, argv, "compute_over_share", WINDOW + 20, lambda e: bool(e.get("instance_id")))
    ended = finish(proc, 10)
    ok = event.get("action") == "killed" and ended
    measured = float(event.get("measured_percent") or 0)
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"{measured:.0f} % of a 20 % share, {event.get('action')} after {after:.1f} s",
        expected="compute_over_share, killed",
        detail="" if ok else f"event {event}, tenant ended: {ended}",
        values={"event": event, "seconds_from_start": after, "tenant_ended": ended},
    )


def run(rig: Rig, runner: Runner) -> None:
    checks = {
        "watchdog.memory": memory_bypass,
        "watchdog.unknown": unknown_process,
        "watchdog.compute": compute_bypass,
    }
    if not any(runner.wanted(n) for n in checks):
        return
    flags = ["--bypass-interval", str(INTERVAL), "--bypass-action", "kill", "--bypass-compute-window", str(WINDOW)]
    try:
        with rig.cgpud("watchdog", "--mode", "core_mem", "--compute-policy", "3", *flags) as d:
            for name, fn in checks.items():
                runner.check(name, GROUP, partial(fn, rig, d))
    except CheckError as e:
        runner.fail_rest(tuple(checks), GROUP, str(e))
