"""Which GPUs to give a request for whole GPUs: the set that is best
joined (NVLink, then the PCIe path) together with the best set of the
same size that is left for the next request; then the better joined of
those; then the lowest indexes. Pure.

A pair's score follows NVIDIA's go-gpuallocator best-effort policy, so
choices compare with its: each NVLink between the two is worth 100, and
the PCIe path adds 60 (same board) down to 10 (across CPU sockets); a set
scores the sum over its pairs. go-gpuallocator partitions every free GPU
into sets of the requested size and takes a set of the best partition;
for one GPU every partition scores 0 and it takes the first, breaking a
linked pair the next two-GPU request needed. Looking at the best set left
behind instead takes a GPU whose partner is already gone
(tests/integration/test_topology.py asks both every request on three
machines and shows where and why they differ)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# NVML's nvmlGpuTopologyLevel_t.
INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM = 0, 10, 20, 30, 40, 50
_PCIE_SCORE = {INTERNAL: 60, SINGLE: 50, MULTIPLE: 40, HOSTBRIDGE: 30, NODE: 20, SYSTEM: 10}
NVLINK_SCORE = 100


@dataclass(frozen=True)
class Link:
    """How two GPUs are joined: their PCIe common ancestor (an NVML level)
    and the NVLinks between them."""

    level: int = SYSTEM
    nvlinks: int = 0

    @property
    def score(self) -> int:
        return self.nvlinks * NVLINK_SCORE + _PCIE_SCORE.get(self.level, 0)


# (a, b) with a < b -> their Link; pairs absent are SYSTEM apart, no NVLink.
Links = Mapping[tuple[int, int], Link]


def link(links: Links, a: int, b: int) -> Link:
    return links.get((min(a, b), max(a, b)), Link())


def set_score(links: Links, gpus: Iterable[int]) -> int:
    return sum(link(links, a, b).score for a, b in itertools.combinations(sorted(gpus), 2))


def best_left(links: Links, left: Sequence[int], size: int) -> int:
    """How well joined what is left is: the score of its best set of `size`
    GPUs, of at least a pair, of at most all that is left."""
    size = min(max(size, 2), len(left))
    if size < 2:
        return 0
    return max(set_score(links, s) for s in itertools.combinations(left, size))


def best_set(
    links: Links, available: Sequence[int], size: int, required: Sequence[int] = (), prefer: Sequence[int] = ()
) -> tuple[int, ...]:
    """`size` GPUs of `available`, `required` among them: the set that with
    the best set of the same size left behind scores most, then the better
    joined, then the set whose most preferred GPU comes first in `prefer`
    (a placement's order; by default the lowest index). ValueError if it
    cannot be done."""
    free = sorted(set(available))
    must = sorted(set(required))
    if not set(must) <= set(free):
        raise ValueError(f"required GPUs {must} are not all available ({free})")
    if not len(must) <= size <= len(free):
        raise ValueError(f"cannot choose {size} of {len(free)} available GPUs with {len(must)} required")
    others = [g for g in free if g not in must]
    candidates = [tuple(sorted((*must, *extra))) for extra in itertools.combinations(others, size - len(must))]

    rank = {g: i for i, g in enumerate(prefer)}

    def value(chosen: tuple[int, ...]) -> tuple[int, int, list[tuple[int, int]]]:
        score = set_score(links, chosen)
        left = best_left(links, [g for g in free if g not in chosen], size)
        return (score + left, score, sorted(((-rank.get(g, len(rank)), -g) for g in chosen), reverse=True))

    return max(candidates, key=value)
