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

The baseline is another build's virtual environment (`--baseline-venv`),
its own cgpud. Most of a start is importing modules, so both sides must
start from bytecode: the processes run without PYTHONDONTWRITEBYTECODE,
and an untimed first round writes what is missing (a tree whose .pyc were
never written compiles every module at every start: 70-80 ms here).

Run from the repository root:
    .venv/bin/python -m bench.bench_daemon_start --baseline-venv /tmp/base/.venv [--rounds 15]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.bench_package import CannotMeasure, start_to_ready
from bench.harness import startup_sides
from bench.table import ab_row, print_table
from cgpud.native import native_path
from tests.harness.net import free_port

CONFIGS = ("standalone", "capacity")


def config_args(name: str) -> list[str]:
    if name == "capacity":
        return ["--capacity-listen", f"127.0.0.1:{free_port()}"]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    rounds, sides = startup_sides(__doc__.splitlines()[0], "cgpud", 15, argv)
    sim_lib = native_path("sim")
    times: dict[tuple[str, str], list[float]] = {(s, c): [] for s in sides for c in CONFIGS}
    root = Path(tempfile.mkdtemp(prefix="cgpu-start-"))
    try:
        for r in range(-1, rounds):  # round -1: untimed, writes the bytecode
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for config in CONFIGS:
                for side in order:
                    tmp = root / f"{r}-{config}-{side.replace(' ', '-')}"
                    seconds = start_to_ready(sides[side], sim_lib, tmp, config_args(config))
                    if r >= 0:
                        times[(side, config)].append(seconds * 1e3)
                    shutil.rmtree(tmp, ignore_errors=True)
    except CannotMeasure as e:
        print(f"cannot measure: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [ab_row(c, times[("this tree", c)], times[("baseline", c)], spread=True) for c in CONFIGS]
    print(f"cgpud exec to READY=1, ms, median (min-max) of {rounds} interleaved rounds")
    print_table(["configuration", "this tree", "baseline", "this / baseline"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
