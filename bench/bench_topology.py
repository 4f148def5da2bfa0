"""How long choosing whole GPUs by topology takes (cgpud.node.topology.
best_set): what GetPreferredAllocation, the node's admission and
cgpu-scheduler's filter spend on a request for several GPUs.

Each case is timed for best_set (its pruned search) and for the plain rule
it must equal (every candidate set, every set left behind), interleaved
round by round; the median and the ratio are printed. The plain rule is
skipped where one run of it would take longer than --plain-limit seconds.
Machines: DGX-1 (8 GPUs, cgpud/cli/sim_topology.py's links) and a 16-GPU
node with random links (seeded) and one with all GPUs joined alike.

Run from the repository root:
    .venv/bin/python -m bench.bench_topology [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from bench.table import print_table
from cgpud.node.topology import HOSTBRIDGE, NODE, SINGLE, SYSTEM, Link, Links, best_set, set_score

DGX1_NVLINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
    (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}  # fmt: skip


def dgx1() -> dict[tuple[int, int], Link]:
    def level(a: int, b: int) -> int:
        if a // 4 != b // 4:
            return SYSTEM
        return SINGLE if a // 2 == b // 2 else HOSTBRIDGE

    return {(a, b): Link(level(a, b), DGX1_NVLINKS.get((a, b), 0)) for a, b in itertools.combinations(range(8), 2)}


def random_links(n: int, seed: int = 1) -> dict[tuple[int, int], Link]:
    rng = random.Random(seed)
    return {
        (a, b): Link(rng.choice([SINGLE, HOSTBRIDGE, NODE, SYSTEM]), rng.choice([0, 0, 1, 2]))
        for a, b in itertools.combinations(range(n), 2)
    }


def plain(links: Links, available: Sequence[int], size: int) -> tuple[int, ...]:
    free = sorted(available)

    def value(c: tuple[int, ...]) -> tuple[int, int, list[int]]:
        left = [g for g in free if g not in c]
        k = min(max(size, 2), len(left))
        rest = max((set_score(links, s) for s in itertools.combinations(left, k)), default=0) if k >= 2 else 0
        return (set_score(links, c) + rest, set_score(links, c), [-g for g in c])

    return max(itertools.combinations(free, size), key=value)


def timed(fn: Callable[[Links, list[int], int], object], links: Links, gpus: list[int], size: int) -> float:
    start = time.perf_counter()
    fn(links, gpus, size)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--plain-limit", type=float, default=2.0, help="seconds one run of the plain rule may take")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    machines = {"dgx1 (8)": dgx1(), "random (16)": random_links(16)}
    machines["alike (16)"] = {pair: Link(SYSTEM) for pair in machines["random (16)"]}
    rows = []
    for name, links in machines.items():
        n = 1 + max(b for _, b in links)
        for size in (1, 2, 4, 8):
            if size >= n:
                continue
            gpus = list(range(n))
            try_plain = timed(plain, links, gpus, size) <= args.plain_limit
            if try_plain and plain(links, gpus, size) != best_set(links, gpus, size):
                print(f"bench_topology: {name} size {size}: best_set differs from the plain rule", file=sys.stderr)
                return 1
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(timed(best_set, links, gpus, size))
                if try_plain:
                    theirs.append(timed(plain, links, gpus, size))
            om = statistics.median(ours)
            pm = statistics.median(theirs) if theirs else None
            rows.append(
                (
                    f"{name}, {size} of {n}",
                    f"{om * 1000:.2f} ms",
                    f"{pm * 1000:.2f} ms" if pm is not None else f"> {args.plain_limit:.0f} s",
                    f"{om / pm:.3f}" if pm else "-",
                )
            )
    print_table(("machine, request", "best_set median", "plain rule median", "ratio"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
