"""Which GPUs to give a request for several GPUs, or for whole GPUs on a
topology node: the set that is best joined (NVLink, then the PCIe path)
together with the best set of the same size left for the next request;
then the better joined of those; then placement's order. Pure.

A pair's score follows NVIDIA's go-gpuallocator best-effort policy, so
choices compare with its: each NVLink between the two is worth 100, and
the PCIe path adds 60 (same board) down to 10 (across CPU sockets); a set
scores the sum over its pairs. go-gpuallocator partitions every free GPU
into sets of the requested size and takes a set of the best partition;
for one GPU every partition scores 0 and it takes the first, breaking a
linked pair the next two-GPU request needed. Looking at the best set left
behind instead takes a GPU whose partner is already gone
(tests/integration/test_topology.py asks both every request on four
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
    return _Scores(links, left).best(left, min(max(size, 2), len(left)))


class _Scores:
    """Pair scores of the GPUs in play, in a matrix: the searches below add
    them up thousands of times."""

    def __init__(self, links: Links, gpus: Sequence[int]) -> None:
        self.pair = {(a, b): link(links, a, b).score for a, b in itertools.combinations(sorted(gpus), 2)}

    def of(self, chosen: Sequence[int]) -> int:
        pair = self.pair
        return sum(pair[(a, b)] for a, b in itertools.combinations(chosen, 2))

    def best(self, gpus: Sequence[int], size: int, ceiling: int | None = None) -> int:
        """The best score of `size` of `gpus` (sorted); stops at `ceiling`,
        which nothing beats."""
        if size < 2 or len(gpus) < size:
            return 0
        top = 0
        for chosen in itertools.combinations(gpus, size):
            score = self.of(chosen)
            if score > top:
                top = score
                if ceiling is not None and top >= ceiling:
                    break
        return top


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
    scores = _Scores(links, free)
    rank = {g: i for i, g in enumerate(prefer)}
    others = [g for g in free if g not in must]
    left_size = max(size, 2)

    def preference(chosen: tuple[int, ...]) -> list[tuple[int, int]]:
        return sorted(((-rank.get(g, len(rank)), -g) for g in chosen), reverse=True)

    candidates = [tuple(sorted((*must, *extra))) for extra in itertools.combinations(others, size - len(must))]
    scored = sorted(((scores.of(c), preference(c), c) for c in candidates), reverse=True)
    # Nothing left behind scores more than the best set of that size among
    # all free GPUs: candidates, best joined first, stop mattering once
    # even that could not lift them to the best found.
    ceiling = scores.best(free, left_size) if len(free) - size >= 2 else 0
    best: tuple[int, int, list[tuple[int, int]], tuple[int, ...]] | None = None
    for score, pref, chosen in scored:
        if best is not None and (score + ceiling, score) < (best[0], best[1]):
            break
        left = [g for g in free if g not in chosen]
        total = score + scores.best(left, min(left_size, len(left)), ceiling)
        if best is None or (total, score, pref) > best[:3]:
            best = (total, score, pref, chosen)
    assert best is not None  # at least one candidate: the size checks above
    return best[3]
