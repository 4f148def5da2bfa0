"""Overhead: what libcgpu adds per intercepted driver call (ns, against the
bare driver, bench/intercept_calls.c run bare and under `cgpuctl run`,
rounds interleaved, medians), and the end-to-end slowdown of a loop of
short real kernels that no share throttles (a memory-only instance)."""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path

from bench.gpu_check.model import CheckError, CheckResult
from bench.gpu_check.rig import Cgpud, Rig, json_line
from bench.gpu_check.runner import Runner, verdict
from bench.gpu_check.compute import rate

GROUP = "overhead"
# ns a call may gain under libcgpu: far above what it adds (bench_intercept's
# targets are 50 and 1000 ns), far below what a lock, a system call per call
# or a round trip to cgpud would cost.
LIMITS_NS = {"launch": 250.0, "allocfree": 2500.0, "meminfo": 500.0, "vmm": 5000.0}
E2E_KERNEL_NS = 50_000


def calls_once(rig: Rig, prefix: list[str], mode: str, calls: int, what: str) -> dict[str, object]:
    out = rig.run([*prefix, str(rig.tools.calls), mode, str(calls)], 120, what).stdout
    report = json_line(out, what)
    if report.get("error"):
        raise CheckError(f"{what}: {report['error']}")
    return report


def per_call(rig: Rig, d: Cgpud, mode: str) -> CheckResult:
    calls = int(rig.seconds(20_000, 100_000))
    rounds = int(rig.seconds(3, 5))
    under = d.run_argv(f"{rig.options.mem_gib}GiB")
    bare: list[float] = []
    cgpu: list[float] = []
    intercepted = True
    for r in range(rounds):
        sides = [("bare", []), ("cgpu", under)]
        for side, prefix in sides if r % 2 == 0 else reversed(sides):
            report = calls_once(rig, prefix, mode, calls, f"intercept_calls {mode} ({side})")
            (bare if side == "bare" else cgpu).append(float(report["ns_per_call"]))  # type: ignore[arg-type]
            if side == "cgpu":
                where = report["resolved_from"]
                assert isinstance(where, dict)
                intercepted &= all(Path(p).resolve() == rig.tools.libcgpu.resolve() for p in where.values())
    added = statistics.median(cgpu) - statistics.median(bare)
    limit = LIMITS_NS[mode]
    ok = intercepted and added <= limit
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"{added:+.1f} ns ({statistics.median(bare):.1f} -> {statistics.median(cgpu):.1f})",
        expected=f"<= +{limit:.0f} ns, every call through libcgpu",
        detail="" if intercepted else "the calls did not go through libcgpu.so",
        values={
            "mode": mode,
            "calls": calls,
            "bare_ns": bare,
            "cgpu_ns": cgpu,
            "added_ns": added,
            "intercepted": intercepted,
        },
    )


def end_to_end(rig: Rig, d: Cgpud) -> CheckResult:
    seconds = rig.seconds(1.0, 5.0)
    rounds = int(rig.seconds(3, 3))
    args = ["--duration", str(seconds), "--kernel-ns", str(E2E_KERNEL_NS), "--sync-every", "64"]
    bare: list[float] = []
    cgpu: list[float] = []
    for r in range(rounds):
        sides = [("bare", []), ("cgpu", d.run_argv(f"{rig.options.mem_gib}GiB"))]
        for side, prefix in sides if r % 2 == 0 else reversed(sides):
            burn = rig.burn(args, seconds + 60, f"kernel loop ({side})", prefix=prefix)
            (bare if side == "bare" else cgpu).append(rate(burn))
    ratio = statistics.median(cgpu) / statistics.median(bare)
    floor = rig.seconds(0.95, 0.97)
    return CheckResult(
        "",
        GROUP,
        verdict(ratio >= floor),
        figure=f"slowdown {(1 - ratio) * 100:+.1f} %",
        expected=f"<= {(1 - floor) * 100:.0f} % slower ({E2E_KERNEL_NS // 1000} us kernels)",
        values={"kernel_ns": E2E_KERNEL_NS, "bare_rate": bare, "cgpu_rate": cgpu, "ratio": ratio},
    )


def run(rig: Rig, runner: Runner) -> None:
    modes = ("launch", "allocfree", "meminfo", "vmm")
    names = (*(f"overhead.{m}" for m in modes), "overhead.kernel-loop")
    if not any(runner.wanted(n) for n in names):
        return
    try:
        with rig.cgpud("overhead", "--mode", "cgpu") as d:
            for m in modes:
                runner.check(f"overhead.{m}", GROUP, partial(per_call, rig, d, m))
            runner.check("overhead.kernel-loop", GROUP, partial(end_to_end, rig, d))
    except CheckError as e:
        runner.fail_rest(names, GROUP, str(e))
