"""Builds and runs cgpu's fuzz targets (see docs/fuzzing.md).

  python tests/fuzz/run.py                     every target, 20 s each
  python tests/fuzz/run.py --runs 1000000 region relay_client
  python tests/fuzz/run.py --seconds 600 --keep DIR py_bundle

C targets are libFuzzer programs built with clang and
-fsanitize=fuzzer,address,undefined; Python targets run under atheris (which
is libFuzzer too), so every target reports the same figures. Each run starts
from the committed seeds (tests/fuzz/corpus/<target>) and first replays the
inputs that once broke something (tests/fuzz/regressions/<target>); new
inputs go to a scratch directory (or --keep DIR), never into the tree."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"
CFLAGS = (
    "-std=c11",
    "-g",
    "-O1",
    "-fno-omit-frame-pointer",
    "-fsanitize=fuzzer,address,undefined",
    "-fno-sanitize-recover=all",
    "-Wall",
    "-Wextra",
    "-Werror",
)
INCLUDES = (CSRC / "include", CSRC, CSRC / "intercept", CSRC / "hook", HERE)
sys.path.insert(0, str(CSRC))
import build_native  # noqa: E402  # the relays need CGPU_VERSION, passed as in every build

SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:allocator_may_return_null=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


@dataclass(frozen=True)
class Target:
    name: str
    source: str  # under tests/fuzz: a .c file (libFuzzer) or a .py file (atheris)
    max_len: int = 4096
    libs: tuple[str, ...] = ()

    @property
    def python(self) -> bool:
        return self.source.endswith(".py")


TARGETS = (
    Target("region", "fuzz_region.c", 8192),
    Target("libcgpu_load", "fuzz_libcgpu_load.c", 8192, ("-ldl", "-lpthread")),
    Target("relay_client", "fuzz_relay_client.c", 8192),
    Target("runtime_shim", "fuzz_runtime_shim.c", 8192),
    Target("hook_relay", "fuzz_hook_relay.c", 8192, ("-lpthread",)),
    Target("py_relay_server", "py_relay_server.py", 8192),
    Target("py_bundle", "py_bundle.py", 8192),
)
BY_NAME = {t.name: t for t in TARGETS}


@dataclass(frozen=True)
class Result:
    target: str
    executed: int
    seconds: int
    coverage: int  # libFuzzer "cov": edges (C) or Python branches (atheris) reached
    features: int  # libFuzzer "ft"
    corpus: int
    crashed: bool
    log: Path

    def row(self) -> str:
        return (
            f"{self.target:16} {self.executed:>10} {self.seconds:>6} {self.coverage:>6} {self.features:>7} "
            f"{self.corpus:>6}  {'CRASH ' + str(self.log) if self.crashed else 'ok'}"
        )


class FuzzError(RuntimeError):
    pass


def clang() -> str:
    for cc in (os.environ.get("CGPU_FUZZ_CC"), "clang", "clang-16", "clang-15", "clang-14"):
        if cc and shutil.which(cc):
            return cc
    raise FuzzError("no clang found: install clang and libclang-rt-*-dev (./dev test installs them)")


def build(target: Target, out_dir: Path) -> list[str]:
    """The command that runs the target's fuzzer."""
    if target.python:
        return [sys.executable, str(HERE / target.source)]
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / f"fuzz_{target.name}"
    cmd = [
        clang(),
        *CFLAGS,
        build_native.version_define(),
        *(f"-I{i}" for i in INCLUDES),
        str(HERE / target.source),
        "-o",
        str(exe),
        *target.libs,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FuzzError(f"building {target.name} failed:\n$ {' '.join(cmd)}\n{proc.stderr}")
    return [str(exe)]


def _last(pattern: str, text: str) -> int:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else 0


def environment(work: Path) -> dict[str, str]:
    scratch = work / "tmp"  # Python harnesses make their bundles and regions here
    scratch.mkdir(parents=True, exist_ok=True)
    # A relay must not wait for a cgpud that is not there: the harness's
    # server is the only socket it may reach, and a silent answer is an input.
    return {
        **os.environ,
        **SANITIZER_ENV,
        "PYTHONPATH": str(HERE.parents[1]),
        "TMPDIR": str(scratch),
        "CGPU_RELAY_WAIT_MS": "0",
    }


def run(
    target: Target, command: list[str], work: Path, *, runs: int | None, seconds: int | None, keep: Path | None = None
) -> Result:
    """One fuzzing session: replays the regressions, then fuzzes from the seeds."""
    env = environment(work)
    regressions = sorted((HERE / "regressions" / target.name).glob("*"))
    log = work / f"{target.name}.log"
    if regressions:
        proc = subprocess.run(
            [*command, *map(str, regressions)], env=env, capture_output=True, text=True, errors="replace"
        )
        if proc.returncode != 0:
            log.write_text(proc.stdout + proc.stderr)
            return Result(target.name, 0, 0, 0, 0, 0, True, log)
    corpus = keep or work / f"{target.name}-corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    args = [
        *command,
        str(corpus),
        str(HERE / "corpus" / target.name),
        f"-max_len={target.max_len}",
        f"-artifact_prefix={work}/{target.name}-",
        "-print_final_stats=1",
        "-close_fd_mask=1",
    ]
    if runs is not None:
        args.append(f"-runs={runs}")
    if seconds is not None:
        args.append(f"-max_total_time={seconds}")
    with log.open("w") as out:
        proc = subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=out)
    text = log.read_text(errors="replace")
    done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)", text)
    executed = _last(r"stat::number_of_executed_units: (\d+)", text)
    cov, ft, corp = (int(x) for x in done[-1][1:]) if done else (0, 0, 0)
    crashed = proc.returncode != 0 or any(work.glob(f"{target.name}-crash-*")) or "ERROR: " in text
    return Result(target.name, executed, _last(r"Done \d+ runs in (\d+) second", text), cov, ft, corp, crashed, log)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", help=f"default: all ({', '.join(BY_NAME)})")
    parser.add_argument("--runs", type=int, help="inputs per target")
    parser.add_argument("--seconds", type=int, help="seconds per target (default 20 without --runs)")
    parser.add_argument("--work", type=Path, help="build, logs and crashes (default: a temporary directory)")
    parser.add_argument("--keep", type=Path, help="keep the inputs found here (one target only)")
    args = parser.parse_args(argv)
    unknown = [t for t in args.targets if t not in BY_NAME]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}: choose from {', '.join(BY_NAME)}")
    targets = [BY_NAME[t] for t in args.targets] or list(TARGETS)
    if args.keep and len(targets) != 1:
        parser.error("--keep takes one target")
    seconds = args.seconds if args.seconds or args.runs else 20
    work = args.work or Path(tempfile.mkdtemp(prefix="cgpu-fuzz-"))
    print(f"{'target':16} {'executed':>10} {'secs':>6} {'cov':>6} {'ft':>7} {'corp':>6}  result (work: {work})")
    failed = False
    for target in targets:
        try:
            command = build(target, work / "bin")
        except FuzzError as e:
            print(e, file=sys.stderr)
            return 1
        result = run(target, command, work, runs=args.runs, seconds=seconds, keep=args.keep)
        print(result.row(), flush=True)
        failed |= result.crashed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
