"""cgpud.node.topology: whole-GPU choices by how GPUs are joined (the side
by side with go-gpuallocator is tests/integration/test_topology.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.node.topology import HOSTBRIDGE, NODE, SINGLE, SYSTEM, Link, best_set, set_score

# Two NVLink pairs (0-1, 2-3); 0 and 2 share a host bridge.
LINKS = {
    (0, 1): Link(NODE, 2),
    (2, 3): Link(NODE, 2),
    (0, 2): Link(HOSTBRIDGE),
    (0, 3): Link(SYSTEM),
    (1, 2): Link(SYSTEM),
    (1, 3): Link(SYSTEM),
}


def test_scores_follow_go_gpuallocator() -> None:
    assert Link(SINGLE, 0).score == 50 and Link(SYSTEM, 2).score == 210 and Link().score == 10
    assert set_score(LINKS, (0, 1, 2)) == 220 + 30 + 10


def test_a_pair_goes_to_a_pair_and_one_gpu_to_a_broken_pair() -> None:
    assert best_set(LINKS, [0, 1, 2, 3], 2) == (0, 1)
    assert best_set(LINKS, [0, 1, 2], 1) == (2,)
    assert best_set(LINKS, [0, 1, 2, 3], 2, required=[3]) == (2, 3)


def test_gpus_without_links_go_in_index_order() -> None:
    assert best_set({}, [3, 1, 2], 2) == (1, 2)


@pytest.mark.parametrize(
    ("available", "size", "required", "message"),
    [([0, 1], 3, [], "cannot choose 3 of 2"), ([0, 1], 1, [2], r"required GPUs \[2\] are not all available")],
)
def test_impossible_requests_say_why(available: list[int], size: int, required: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        best_set(LINKS, available, size, required)


def _reference(links, available, size, required=(), prefer=()):  # type: ignore[no-untyped-def]
    """best_set's rule written plainly: every candidate, every set left."""
    import itertools

    free = sorted(available)
    rank = {g: i for i, g in enumerate(prefer)}

    def value(c):  # type: ignore[no-untyped-def]
        left = [g for g in free if g not in c]
        k = min(max(size, 2), len(left))
        best_left = max((set_score(links, s) for s in itertools.combinations(left, k)), default=0) if k >= 2 else 0
        pref = sorted(((-rank.get(g, len(rank)), -g) for g in c), reverse=True)
        return (set_score(links, c) + best_left, set_score(links, c), pref)

    candidates = [c for c in itertools.combinations(free, size) if set(required) <= set(c)]
    return max(candidates, key=value)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_pruned_search_chooses_what_the_plain_rule_does(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 7))
    level = st.sampled_from([SINGLE, HOSTBRIDGE, NODE, SYSTEM])
    links = {(a, b): Link(data.draw(level), data.draw(st.integers(0, 3))) for a in range(n) for b in range(a + 1, n)}
    available = data.draw(st.lists(st.integers(0, n - 1), min_size=1, unique=True))
    size = data.draw(st.integers(1, len(available)))
    required = data.draw(st.lists(st.sampled_from(available), max_size=size, unique=True))
    prefer = data.draw(st.permutations(available))
    assert best_set(links, available, size, required, prefer) == _reference(links, available, size, required, prefer)
