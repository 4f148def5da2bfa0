"""What one runtime command costs when a wrapper sits in front of runc.

containerd and Docker run the configured runtime binary once per command,
and a container needs three (create, start, delete). cgpu-runtime (its
front, built without libc where it can be: csrc/hook/runtime_front.c)
passes a non-GPU command straight to runc with one more execve; this
measures that execve beside a minimal C program on libc that only execs
runc, built here dynamically and statically linked: what a wrapper costs
whose start-up is glibc's. Each is timed from the spawn to the exit
(pidfd), running `--root R list` on an empty state directory, in a fresh
random order each round, beside runc alone.

It is a report (exit 0 whatever the figures; 1 when it cannot measure).
Needs runc and a C compiler (`cc`).

Run from the repository root:
    .venv/bin/python -m bench.bench_runtime_exec [--rounds 300] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_container_start import median_ci, wait_exact
from bench.harness import BenchError, exit_with
from bench.table import print_table
from cgpud.native import native_path

COMMANDS_PER_CONTAINER = 3  # create, start, delete
WRAPPER_C = """#include <unistd.h>
int main(int argc, char **argv) { (void)argc; execv(RUNC, argv); return 127; }
"""


def build_wrappers(work: Path, runc: str) -> dict[str, Path]:
    cc = shutil.which("cc")
    if cc is None:
        raise BenchError("no C compiler (cc) on PATH to build the minimal wrappers")
    src = work / "wrapper.c"
    src.write_text(WRAPPER_C)
    built = {}
    for name, flags in (("dynamic", []), ("static", ["-static"])):
        out = work / f"wrapper-{name}"
        cmd = [cc, "-O2", f'-DRUNC="{runc}"', *flags, "-o", str(out), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BenchError(f"{shlex.join(cmd)} failed: {done.stderr.strip()}")
        built[name] = out
    return built


def time_once(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    status = wait_exact(proc, 30)
    ms = (time.perf_counter() - t0) * 1e3
    if status != 0:
        detail = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise BenchError(f"{shlex.join(argv)} exited {status}: {detail}")
    if proc.stderr:
        proc.stderr.close()
    return ms


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300, help="timed runs per variant, interleaved (300)")
    p.add_argument("--seed", type=int, default=1, help="seed of the per-round shuffle (1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    runc = shutil.which("runc")
    if runc is None:
        raise BenchError("runc is not on PATH")
    shim = native_path("bin/cgpu-runtime")
    if not shim.exists():
        raise BenchError(f"{shim} is missing: run `pip install -e .`")
    print("command:", shlex.join([sys.executable, *sys.argv]), f"(cwd {Path.cwd()})")
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-exec-") as tmp:
        work = Path(tmp)
        wrappers = build_wrappers(work, runc)
        root = work / "runc-root"
        root.mkdir()
        # The shim never reaches cgpud for `list`; a socket that is not there proves it.
        env = dict(os.environ, CGPU_REAL_RUNTIME=runc, CGPU_RELAY_SOCKET=str(work / "no-cgpud.sock"))
        variants = {
            "runc": [runc, "--root", str(root), "list"],
            "cgpu-runtime": [str(shim), "--root", str(root), "list"],
            "wrapper, dynamic": [str(wrappers["dynamic"]), "--root", str(root), "list"],
            "wrapper, static": [str(wrappers["static"]), "--root", str(root), "list"],
        }
        print(
            f"host:    {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
            f"{args.rounds} rounds, a fresh order each (--seed {args.seed})",
            flush=True,
        )
        ms: dict[str, list[float]] = {k: [] for k in variants}
        rng = random.Random(args.seed)
        for _ in range(2):  # warm-up: page cache, the first exec of each
            for cmd in variants.values():
                time_once(cmd, env)
        for _ in range(args.rounds):
            for k in rng.sample(list(variants), len(variants)):
                ms[k].append(time_once(variants[k], env))
        print(f"host:    load average {os.getloadavg()[0]:.2f} at end\n")
        base = ms["runc"]
        rows = []
        for k, values in ms.items():
            paired = [x - y for x, y in zip(values, base)]
            lo, hi = median_ci(paired)
            added = "" if k == "runc" else f"{statistics.median(paired):+.3f} [{lo:+.3f}, {hi:+.3f}]"
            rows.append((k, f"{statistics.median(values):.3f}", added))
        print_table(("runtime command (`--root R list`)", "median ms", "added vs runc, paired [~95%]"), rows)
        shim_added = statistics.median([x - y for x, y in zip(ms["cgpu-runtime"], base)])
        floor = statistics.median([x - y for x, y in zip(ms["wrapper, static"], base)])
        print(
            f"\nPer container ({COMMANDS_PER_CONTAINER} commands): cgpu-runtime adds "
            f"{COMMANDS_PER_CONTAINER * shim_added:+.2f} ms; a minimal wrapper on static glibc "
            f"{COMMANDS_PER_CONTAINER * floor:+.2f} ms"
        )
    return 0


if __name__ == "__main__":
    exit_with("bench_runtime_exec", main)
