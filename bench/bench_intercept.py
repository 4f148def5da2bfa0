"""Overhead of libcgpu.so per intercepted CUDA driver call.

Builds bench/intercept_calls.c, creates a private simulated machine (one GPU of
16 GiB) and instance regions with an 8 GiB memory limit on it, then for each
mode runs, side by side and interleaved, R rounds of {bare driver, driver +
LD_PRELOAD=libcgpu.so} and reports the median ns per call of each, the ns
added and the ratio. Modes: cuLaunchKernel with no region (launch-noregion),
in a region whose gate is ungated (launch) and in one whose gate is open for
the whole run, the process holding the grant (launch-open), and in one
whose gate cgpud left paced (fixed_windows: the process keeps to its window,
here one of an hour less a second, by itself; launch-paced);
cuMemAlloc_v2+cuMemFree_v2 (allocfree); cuMemGetInfo_v2 (meminfo); a VMM
cycle of 2 MiB, cuMemCreate+cuMemMap+cuMemRelease+cuMemUnmap into a range
reserved once (vmm). Then it
counts instructions per call with callgrind, which does not drift with load:
(Ir(2N) - Ir(N)) / N for each configuration, so start-up and warm-up cancel.

Prints a table and the targets with PASS/FAIL. It is a report: the exit status
is 0 whether or not a target is met, 1 on an error (build, setup, a failed CUDA
call), 2 on a bad argument.

Run from the repository root:
    .venv/bin/python -m bench.bench_intercept [--rounds 7] [--calls 200000]
        [--modes launch-noregion,launch,launch-open,launch-paced,allocfree,meminfo,vmm] [--no-callgrind]
        [--baseline-library OTHER/libcgpu.so]

With --baseline-library, another build (e.g. main's) runs as a third side in
the same rounds and callgrind counts, so before and after come from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import BenchError, exit_with
from bench.table import print_table
from cgpud._region import ffi, lib
from cgpud.node.region import DeviceLimit, InstanceLimits, write_region
from cgpud.native import native_dir

ROOT = Path(__file__).resolve().parent.parent
MODES = ("launch-noregion", "launch", "launch-open", "launch-paced", "allocfree", "meminfo", "vmm")
LABELS = {
    "launch-noregion": "cuLaunchKernel, no region",
    "launch": "cuLaunchKernel, gate ungated",
    "launch-open": "cuLaunchKernel, gate open",
    "launch-paced": "cuLaunchKernel, paced in a window",
    "allocfree": "cuMemAlloc_v2+cuMemFree_v2",
    "meminfo": "cuMemGetInfo_v2",
    "vmm": "cuMemCreate+Map+Release+Unmap",
}
# What intercept_calls runs, and under which preloaded configuration.
PROGRAM = {"launch-noregion": "launch", "launch-open": "launch", "launch-paced": "launch"}
CONFIG = {"launch-noregion": "noregion", "launch-open": "open", "launch-paced": "paced"}  # others: "ungated"
# launch-paced's window: all of every hour but its last second (CLOCK_MONOTONIC).
PACED_PERIOD_NS = 3600 * 10**9
PACED_LEN_NS = PACED_PERIOD_NS - 10**9
MEM_LIMIT = 8 << 30
SIM_CONFIG = 'gpu name="NVIDIA H100 80GB HBM3" mem=16GiB sms=132\n'
RUN_TIMEOUT_S = 300

# (mode, metric, limit, unit, description) -- from issues 1 (ns) and 39 (Ir).
TARGETS = (
    ("launch", "ns", 50.0, "ns", "cuLaunchKernel (gate ungated) added time"),
    ("launch", "ir", 20.0, "instructions", "cuLaunchKernel (gate ungated) added instructions"),
    ("launch-open", "ns", 100.0, "ns", "cuLaunchKernel (gate open, grant held) added time"),
    ("launch-open", "ir", 40.0, "instructions", "cuLaunchKernel (gate open, grant held) added instructions"),
    ("allocfree", "ns", 1000.0, "ns", "cuMemAlloc_v2+cuMemFree_v2 pair added time"),
    ("allocfree", "ir", 200.0, "instructions", "cuMemAlloc_v2+cuMemFree_v2 pair added instructions"),
    ("vmm", "ir", 400.0, "instructions", "VMM create+map+release+unmap cycle added instructions"),
)


@dataclass
class ModeResult:
    bare_ns: list[float] = field(default_factory=list)
    cgpu_ns: list[float] = field(default_factory=list)
    base_ns: list[float] = field(default_factory=list)  # --baseline-library
    bare_ir: float | None = None
    cgpu_ir: float | None = None
    base_ir: float | None = None
    intercepted: dict[str, bool] = field(default_factory=dict)
    cycle_bytes: int | None = None  # vmm: the size created and mapped per cycle

    def rounds(self, which: str) -> list[float]:
        return {"bare": self.bare_ns, "cgpu": self.cgpu_ns, "base": self.base_ns}[which]

    def median(self, which: str) -> float:
        return statistics.median(self.rounds(which))

    def spread(self, which: str) -> float:
        """Interquartile range of the rounds: how far apart the middle half lies."""
        values = self.rounds(which)
        if len(values) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return q3 - q1

    @property
    def added_ns(self) -> float:
        return self.median("cgpu") - self.median("bare")

    @property
    def ratio(self) -> float:
        return self.median("cgpu") / self.median("bare")

    @property
    def added_ir(self) -> float | None:
        if self.bare_ir is None or self.cgpu_ir is None:
            return None
        return self.cgpu_ir - self.bare_ir

    @property
    def base_added_ir(self) -> float | None:
        if self.bare_ir is None or self.base_ir is None:
            return None
        return self.base_ir - self.bare_ir


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per mode (7)")
    p.add_argument("--calls", type=int, default=200000, help="timed calls per run (200000)")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (all)",
    )
    p.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts")
    p.add_argument(
        "--callgrind-calls",
        type=int,
        default=2000,
        help="N for the instruction counts: runs with N and 2N calls (2000)",
    )
    p.add_argument(
        "--library",
        type=Path,
        default=None,
        help="interception library to preload (the built lib/libcgpu.so)",
    )
    p.add_argument(
        "--baseline-library",
        type=Path,
        default=None,
        help="another build of libcgpu.so (e.g. main's) run as a third side in the same rounds",
    )
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: unknown mode {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}")
    if args.rounds < 1 or args.calls < 1 or args.callgrind_calls < 1:
        p.error("--rounds, --calls and --callgrind-calls must be at least 1")
    return args


def run(cmd: list[str], env: dict[str, str], what: str) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"{what}: {shlex.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-5:]
        raise BenchError(f"{what} exited {proc.returncode}: {shlex.join(cmd)}\n  " + "\n  ".join(detail))
    return proc


def build(workdir: Path) -> tuple[Path, list[str]]:
    cc = os.environ.get("CC", "cc")
    exe = workdir / "intercept_calls"
    cmd = [
        cc,
        "-O2",
        "-g",
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-I",
        "csrc/include",
        "bench/intercept_calls.c",
        "-o",
        str(exe),
        "-ldl",
    ]
    run(cmd, dict(os.environ), "building bench/intercept_calls.c")
    return exe, cmd


def machine(workdir: Path, native: Path) -> dict[str, str]:
    """Environment of a private simulated machine, with no preload inherited."""
    config = workdir / "sim.conf"
    config.write_text(SIM_CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CGPU_REGION_DIR")}
    env["LD_LIBRARY_PATH"] = str(native / "sim")
    env["CGPU_SIM_CONFIG"] = str(config)
    env["CGPU_SIM_STATE"] = str(workdir / "sim.state")
    return env


def gpu0_uuid(native: Path, env: dict[str, str]) -> str:
    """Asked of the simulated driver (cgpu-burn reports it), not assumed."""
    burn = native / "bin" / "cgpu-burn"
    if not burn.exists():
        raise BenchError(f"{burn} is missing: run `pip install -e .` in {ROOT}")
    out = run([str(burn)], env, "reading GPU 0's UUID with cgpu-burn").stdout
    return json.loads(out)["uuid"]


def make_region(directory: Path, uuid: str, gate: int, paced: bool = False) -> Path:
    """An instance region on GPU 0 whose gate the scheduler leaves at `gate`
    for the whole run (nobody closes it); `paced`: the grant names that
    (closed) word as paced, in PACED_LEN_NS of every PACED_PERIOD_NS."""
    write_region(directory, InstanceLimits("bench", devices=(DeviceLimit(uuid, MEM_LIMIT, 0),)))
    raw = ffi.new("struct cgpu_grants *")
    raw.magic = lib.CGPU_GRANTS_MAGIC
    raw.version = lib.CGPU_REGION_VERSION
    raw.size = ffi.sizeof("struct cgpu_grants")
    raw.device[0].gate = gate
    if paced:
        raw.device[0].paced = gate
        raw.device[0].alone_period_ns = PACED_PERIOD_NS
        raw.device[0].alone_len_ns = PACED_LEN_NS
    (directory / "grants").write_bytes(bytes(ffi.buffer(raw)))
    return directory


def parse_report(out: str, what: str) -> dict:
    """The JSON line of intercept_calls, which must report no failed call."""
    try:
        report = json.loads(out)
    except json.JSONDecodeError as exc:
        raise BenchError(f"{what}: unreadable output {out!r}") from exc
    if report.get("error"):
        raise BenchError(f"{what}: {report['error']}")
    return report


def measure(exe: Path, mode: str, calls: int, env: dict[str, str], what: str) -> dict:
    return parse_report(run([str(exe), PROGRAM.get(mode, mode), str(calls)], env, what).stdout, what)


def resolved_in(report: dict, path: Path) -> dict[str, bool]:
    return {fn: Path(where).resolve() == path.resolve() for fn, where in report["resolved_from"].items()}


def timed_rounds(
    exe: Path, mode: str, args: argparse.Namespace, envs: dict[str, dict[str, str]], driver: Path, library: Path
) -> ModeResult:
    result = ModeResult()
    for r in range(args.rounds):
        sides = [c for c in ("bare", "cgpu", "base") if c in envs]
        # Rotate which side goes first so that none always runs on a warmer
        # (or busier) machine.
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for config in order:
            report = measure(exe, mode, args.calls, envs[config], f"{mode} round {r + 1} ({config})")
            if config == "bare":
                if not all(resolved_in(report, driver).values()):
                    raise BenchError(f"bare run of {mode} did not call the simulated driver: {report['resolved_from']}")
                result.bare_ns.append(report["ns_per_call"])
            elif config == "cgpu":
                result.intercepted = resolved_in(report, library)
                result.cgpu_ns.append(report["ns_per_call"])
            else:
                result.base_ns.append(report["ns_per_call"])
            result.cycle_bytes = report.get("bytes")
    return result


def callgrind_ir(exe: Path, mode: str, calls: int, env: dict[str, str], out: Path, what: str) -> int:
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(exe), PROGRAM.get(mode, mode), str(calls)]
    parse_report(run(cmd, env, what).stdout, what)
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise BenchError(f"{what}: no instruction total in {out}")


def instructions(exe: Path, mode: str, n: int, env: dict[str, str], workdir: Path, config: str) -> float:
    ir = {}
    for calls in (n, 2 * n):
        out = workdir / f"callgrind.{mode}.{config}.{calls}.out"
        ir[calls] = callgrind_ir(exe, mode, calls, env, out, f"callgrind {mode} x{calls} ({config})")
    return (ir[2 * n] - ir[n]) / n


def fmt(value: float | None, spec: str, sign: bool = False) -> str:
    if value is None:
        return "-"
    return format(value, ("+" if sign else "") + spec)


def report(results: dict[str, ModeResult], args: argparse.Namespace, library: Path) -> None:
    head: tuple[str, ...] = ("call", "bare ns", "cgpu ns", "added ns", "ratio", "bare Ir", "cgpu Ir", "added Ir")
    rows: list[tuple[str, ...]] = [
        (
            LABELS[m],
            fmt(r.median("bare"), ".1f"),
            fmt(r.median("cgpu"), ".1f"),
            fmt(r.added_ns, ".1f", sign=True),
            f"{r.ratio:.2f}x",
            fmt(r.bare_ir, ".1f"),
            fmt(r.cgpu_ir, ".1f"),
            fmt(r.added_ir, ".1f", sign=True),
        )
        for m, r in results.items()
    ]
    if args.baseline_library:
        head += ("base ns", "base added ns", "base Ir", "base added Ir")
        rows = [
            (
                *row,
                fmt(r.median("base"), ".1f"),
                fmt(r.median("base") - r.median("bare"), ".1f", sign=True),
                fmt(r.base_ir, ".1f"),
                fmt(r.base_added_ir, ".1f", sign=True),
            )
            for row, r in zip(rows, results.values(), strict=True)
        ]
    print()
    print(
        f"Per call (allocfree: per alloc+free pair; vmm: per create+map+release+unmap cycle); "
        f"ns = median of {args.rounds} interleaved rounds of {args.calls} calls; "
        f"Ir = instructions per call (callgrind)"
    )
    print_table(head, rows)
    for m, r in results.items():
        if r.cycle_bytes:
            print(
                f"{m}: {r.cycle_bytes / (1 << 20):g} MiB created and mapped per cycle (2 MiB rounded up to the "
                f"allocation granularity); the address range is reserved once, before the timed calls"
            )

    print("\nEach round (ns per call):")
    for m, r in results.items():
        print(f"  {m:<15} bare {' '.join(f'{v:.1f}' for v in r.bare_ns)}  (IQR {r.spread('bare'):.1f})")
        print(f"  {'':<15} cgpu {' '.join(f'{v:.1f}' for v in r.cgpu_ns)}  (IQR {r.spread('cgpu'):.1f})")
        if r.base_ns:
            print(f"  {'':<15} base {' '.join(f'{v:.1f}' for v in r.base_ns)}  (IQR {r.spread('base'):.1f})")
    for r in results.values():
        direct = [fn for fn, hooked in r.intercepted.items() if not hooked]
        if direct:
            print(
                f"  note: under the preload, {', '.join(direct)} resolved to the driver itself, not to "
                f"{library.name}: that call is not intercepted"
            )

    print("\nTargets:")
    for mode, metric, limit, unit, text in TARGETS:
        r = results.get(mode)
        value = None if r is None else (r.added_ns if metric == "ns" else r.added_ir)
        if value is None:
            verdict, shown = "NOT MEASURED", "-"
        else:
            verdict, shown = ("PASS" if value <= limit else "FAIL"), f"{value:+.1f}"
        noise = ""
        if r is not None and metric == "ns" and value is not None:
            spread = max(r.spread("bare"), r.spread("cgpu"))
            if spread > limit:
                noise = f"  [noisy: rounds IQR {spread:.0f} ns > target; the Ir figure is the steady one]"
        print(f"  {verdict:<12} {text}: {shown} (target <= {limit:g} {unit}){noise}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    native = native_dir()
    driver = native / "sim" / "libcuda.so.1"
    library = (args.library or native / "lib" / "libcgpu.so").resolve()
    if args.library and not library.is_file():
        raise BenchError(f"--library {args.library}: no such file")
    baseline = args.baseline_library.resolve() if args.baseline_library else None
    if baseline and not baseline.is_file():
        raise BenchError(f"--baseline-library {args.baseline_library}: no such file")
    for part in (driver, library):
        if not part.exists():
            raise BenchError(f"{part} is missing: run `pip install -e .` in {ROOT}")
    if not args.no_callgrind and not shutil.which("valgrind"):
        raise BenchError("valgrind is not installed; install it or pass --no-callgrind")

    print("command:", shlex.join([sys.executable, *sys.argv]), f"(cwd {Path.cwd()})")
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-") as tmp:
        workdir = Path(tmp)
        exe, build_cmd = build(workdir)
        bare = machine(workdir, native)
        uuid = gpu0_uuid(native, bare)
        preloaded = dict(bare, LD_PRELOAD=str(library))
        ungated = make_region(workdir / "ungated", uuid, lib.CGPU_GATE_UNGATED)
        opened = make_region(workdir / "open", uuid, lib.CGPU_GATE_SEQ_STEP | lib.CGPU_GATE_OPEN)
        paced = make_region(workdir / "paced", uuid, lib.CGPU_GATE_SEQ_STEP, paced=True)
        configs = {
            "noregion": preloaded,
            "ungated": dict(preloaded, CGPU_REGION_DIR=str(ungated)),
            "open": dict(preloaded, CGPU_REGION_DIR=str(opened)),
            "paced": dict(preloaded, CGPU_REGION_DIR=str(paced)),
        }
        envs = {m: {"bare": bare, "cgpu": configs[CONFIG.get(m, "ungated")]} for m in args.modes}
        if baseline:
            for env in envs.values():
                env["base"] = dict(env["cgpu"], LD_PRELOAD=str(baseline))
        print("build:  ", shlex.join(build_cmd))
        print(
            f"run:     LD_LIBRARY_PATH={bare['LD_LIBRARY_PATH']} CGPU_SIM_CONFIG=... CGPU_SIM_STATE=... "
            f"[LD_PRELOAD={library} [CGPU_REGION_DIR=...]] intercept_calls MODE {args.calls}"
        )
        if baseline:
            print(f"base:    the same with LD_PRELOAD={baseline}, a third side in every round")
        if not args.no_callgrind:
            print(
                f"count:   valgrind --tool=callgrind --callgrind-out-file=F intercept_calls MODE "
                f"{args.callgrind_calls} (and {2 * args.callgrind_calls}), in the same environments"
            )
        print(
            f"machine: simulated {SIM_CONFIG.strip()}; regions: {MEM_LIMIT >> 30} GiB limit on {uuid}, "
            f"gate ungated (launch, allocfree, meminfo, vmm) or open for the whole run (launch-open); "
            f"launch-noregion preloads the library with no region"
        )
        print(f"host:    {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")

        results: dict[str, ModeResult] = {}
        for mode in args.modes:
            results[mode] = timed_rounds(exe, mode, args, envs[mode], driver, library)
            print(
                f"  timed {mode}: bare {results[mode].median('bare'):.1f} ns, "
                f"cgpu {results[mode].median('cgpu'):.1f} ns",
                flush=True,
            )
        if not args.no_callgrind:
            for mode in args.modes:
                for config, env in envs[mode].items():
                    ir = instructions(exe, mode, args.callgrind_calls, env, workdir, config)
                    setattr(results[mode], f"{config}_ir", ir)
                print(
                    f"  counted {mode}: bare {results[mode].bare_ir:.1f} Ir, cgpu {results[mode].cgpu_ir:.1f} Ir"
                    + (f", base {results[mode].base_ir:.1f} Ir" if baseline else ""),
                    flush=True,
                )
        print(f"host:    load average {os.getloadavg()[0]:.2f} at end")
        report(results, args, library)
    return 0


if __name__ == "__main__":
    exit_with("bench_intercept", main)
