"""`python -m bench.gpu_check`: every promise checked on this machine's GPU
(docs/gpu-check.md). Prints a table, writes the JSON report, exits 0 when
every check passed or was skipped, 1 when one failed, 2 on bad usage."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from bench.gpu_check import away, build, compute, container, hami, handover, memory, modes, nvml, overhead, watchdog
from bench.gpu_check.model import CheckError, CheckResult, Machine, Report, Status
from bench.gpu_check.rig import Options, Rig, region_mounts, unmount_regions
from bench.gpu_check.runner import Runner, verdict
from cgpud.logs import configure_logging

LOG = structlog.get_logger("gpu-check")
SUITES = (memory, compute, handover, away, overhead, watchdog, container, modes, hami)
FULL_BUDGET_S = 480.0  # the 8 minutes, builds included
QUICK_BUDGET_S = 300.0


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m bench.gpu_check", description=__doc__)
    p.add_argument("--quick", action="store_true", help="shorter measurements, every check still run (CI)")
    p.add_argument("--json", type=Path, help="write the report here (default gpu-check.json in the working directory)")
    p.add_argument("--mem", type=int, default=1, help="the memory limit the checks ask for, GiB (1)")
    p.add_argument("--hami", type=Path, help="HAMi-core's libvgpu.so: run its memory, share and overhead side by side")
    p.add_argument("--only", action="append", default=[], help="run only these checks or groups (repeatable)")
    p.add_argument(
        "--cuda-cache",
        type=Path,
        help="where the PyPI CUDA toolchain is (or is installed); default: inside the run's temporary "
        "directory, removed at the end, so nothing is left on the machine",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, builds) and print it")
    p.add_argument("--budget", type=float, help="seconds for the whole run (480; 300 with --quick)")
    args = p.parse_args(list(argv))
    if args.mem < 1:
        raise UsageError("--mem must be at least 1 (GiB)")
    if args.hami is not None and not args.hami.is_file():
        raise UsageError(f"--hami {args.hami}: no such file")
    return args


def state_of(machine: dict[str, object]) -> list[tuple[object, object]]:
    gpus = machine.get("gpus", [])
    assert isinstance(gpus, list)
    return [(g["mig_mode"], g["compute_mode"]) for g in gpus]


def left_as_found(before: dict[str, object]) -> CheckResult:
    after = nvml.machine()
    found, now = state_of(before), state_of(after)
    return CheckResult(
        "",
        "safety",
        verdict(found == now),
        figure="unchanged" if found == now else f"was {found}, now {now}",
        expected="every GPU's MIG and compute mode as found",
        values={"found": found, "after": now},
    )


def nothing_mounted(work: Path) -> CheckResult:
    left = region_mounts(work)
    return CheckResult(
        "",
        "safety",
        verdict(not left),
        figure=f"{len(left)} mounts left",
        expected="no mount left under the run's directory",
        detail=", ".join(left),
        values={"mounts": left},
    )


def print_report(report: Report) -> None:
    rows = [
        (
            c.name,
            c.status.value,
            c.figure,
            c.expected if c.status is Status.PASS else (c.detail or c.expected),
            f"{c.seconds:.1f}",
        )
        for c in report.checks
    ]
    gpu = ", ".join(str(g["name"]) for g in report.machine.gpus) or "none"
    print(f"gpu-check: {gpu}; driver {report.machine.driver_version} (CUDA {report.machine.cuda_driver_version})")
    head = ("check", "status", "figure", "expected / reason", "s")
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    for row in (head, tuple("-" * w for w in widths), *rows):
        print("  ".join(c.rjust(w) if i == 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    counts = {s: sum(c.status is s for c in report.checks) for s in Status}
    print(
        f"{counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped "
        f"in {report.seconds:.1f} s"
    )


def main(argv: Sequence[str]) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    configure_logging()  # progress on stderr; the table and the report path on stdout
    t0 = time.monotonic()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    work = Path(tempfile.mkdtemp(prefix="cgpu-gpu-check."))
    out = args.json or Path("gpu-check.json")
    try:
        try:
            found = nvml.machine()
        except CheckError as e:
            print(f"gpu-check: {e}", file=sys.stderr)
            return 1
        report = Report(
            Machine(
                driver_version=str(found["driver_version"]),
                cuda_driver_version=int(found["cuda_driver_version"]),
                gpus=list(found["gpus"]),
                nvidia_smi=found["nvidia_smi"],
                runc=found["runc"],
                root=os.geteuid() == 0,
            ),
            quick=args.quick,
            started=started,
        )
        options = Options(quick=args.quick, mem_gib=args.mem, hami=args.hami, only=frozenset(args.only))
        runner = Runner(args.budget or (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S), options.only)
        tools = None

        def setup() -> CheckResult:
            nonlocal tools
            tools = build.build(work, args.cuda_cache or work / "cuda")
            return CheckResult("", "setup", Status.PASS, figure="built", expected="toolchain, spin, intercept_calls")

        runner.check("setup.build", "setup", setup)
        if tools is not None:
            env = dict(os.environ)
            env.pop("LD_PRELOAD", None)
            rig = Rig(work, env, tools, options, found)
            for suite in SUITES:
                suite.run(rig, runner)
        runner.check("safety.state", "safety", lambda: left_as_found(found))
        runner.check("safety.mounts", "safety", lambda: nothing_mounted(work))
        report.checks = runner.results
        report.seconds = round(time.monotonic() - t0, 1)
        print_report(report)
        out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"report: {out}")
        return 1 if report.failed else 0
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            unmount_regions(work)
            shutil.rmtree(work, ignore_errors=True)
