"""cgpud from exec to READY=1, this tree against a baseline, interleaved.

A restart is time every tenant of the node waits for cgpud (a start refused
until it answers, gates under a scheduling policy held closed), so its start
counts. Each round starts cgpud once per side and configuration on one
simulated GPU with a fresh state dir (bench_package.start_to_ready), the
order of the sides alternating; the table gives medians and the ratio.
Configurations:

- standalone: no cluster part (the flags `./dev demo` and the tests use);
- capacity: with the Capacity API on 127.0.0.1 (`--capacity-listen`), as a
  node of a cluster scheduler runs it.

The baseline is another build's cgpud package: `--baseline-venv` (its own
virtual environment's cgpud) or `--baseline-pythonpath` (a directory holding
a built `cgpud/` package, run with this venv's interpreter, e.g. a copy of
this tree's `cgpud/` with the .py files of another commit).

Run from the repository root:
    .venv/bin/python -m bench.bench_daemon_start --baseline-venv /tmp/base/.venv [--rounds 15]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.bench_package import CannotMeasure, start_to_ready
from bench.table import ab_row, print_table
from cgpud.native import native_path
from tests.harness.daemon import BIN
from tests.harness.net import free_port

CONFIGS = ("standalone", "capacity")


def config_args(name: str) -> list[str]:
    if name == "capacity":
        return ["--capacity-listen", f"127.0.0.1:{free_port()}"]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    base = p.add_mutually_exclusive_group(required=True)
    base.add_argument("--baseline-venv", type=Path, help="another build's virtual environment")
    base.add_argument("--baseline-pythonpath", type=Path, help="a directory holding another build's cgpud/")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    sides: dict[str, tuple[Path, dict[str, str]]] = {"this tree": (BIN / "cgpud", {})}
    if args.baseline_venv is not None:
        cgpud = args.baseline_venv / "bin" / "cgpud"
        if not cgpud.exists():
            p.error(f"{cgpud} does not exist: --baseline-venv names a virtual environment with cgpu installed")
        sides["baseline"] = (cgpud, {})
    else:
        if not (args.baseline_pythonpath / "cgpud" / "__init__.py").exists():
            p.error(f"{args.baseline_pythonpath} holds no cgpud/ package")
        sides["baseline"] = (BIN / "cgpud", {"PYTHONPATH": str(args.baseline_pythonpath)})
    sim_lib = native_path("sim")
    times: dict[tuple[str, str], list[float]] = {(s, c): [] for s in sides for c in CONFIGS}
    root = Path(tempfile.mkdtemp(prefix="cgpu-start-"))
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for config in CONFIGS:
                for side in order:
                    cgpud, env = sides[side]
                    tmp = root / f"{r}-{config}-{side.replace(' ', '-')}"
                    seconds = start_to_ready(cgpud, sim_lib, tmp, config_args(config), env)
                    times[(side, config)].append(seconds * 1e3)
                    shutil.rmtree(tmp, ignore_errors=True)
    except CannotMeasure as e:
        print(f"cannot measure: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [ab_row(c, times[("this tree", c)], times[("baseline", c)], spread=True) for c in CONFIGS]
    print(f"cgpud exec to READY=1, ms, median (min-max) of {args.rounds} interleaved rounds")
    print_table(["configuration", "this tree", "baseline", "this / baseline"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
