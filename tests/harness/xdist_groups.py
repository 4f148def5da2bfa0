"""Which tests share an xdist worker in ./dev test's parallel pass
(--dist loadgroup), and in which order the groups start: a module's tests
stay together, so module-scoped fixtures are set up once (what --dist
loadfile does), and the folders below share one worker besides."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

# The real cluster's package-scoped fixture; the two netns cluster modules
# each bring up to 8 cgpuds, and one such cluster at a time is enough for
# two cores.
ONE_WORKER = ("tests/realkube/", "tests/e2e/test_cluster")

# Groups that take minutes on one worker, started first so that the pass
# does not end waiting on one of them (xdist would start the groups with
# the most tests first, and the real cluster's 22 tests came last).
LONG_FIRST = (
    "tests/realkube/",  # 4 to 5 minutes
    "tests/e2e/test_cluster",
    "tests/integration/test_bypass_false_positives.py",  # 60 s by design
    "tests/packaging/test_systemd.py",  # five boots of a systemd: 2 to 3 minutes
    "tests/integration/test_install.py",
    "tests/integration/test_server_floods.py",
)


def _group(item: pytest.Item, one_worker: Sequence[str]) -> str:
    module = item.nodeid.split("::")[0]
    return next((d for d in one_worker if module.startswith(d)), module)


def group_by_module(
    items: list[pytest.Item], one_worker: Sequence[str] = ONE_WORKER, long_first: Sequence[str] = LONG_FIRST
) -> None:
    """Marks every test without an xdist_group with its module's (or its
    ONE_WORKER prefix's) group, and orders the groups: LONG_FIRST's, then
    the rest by their number of tests, as xdist would (run the pass with
    --no-loadscope-reorder to keep this order). Call it from a tryfirst
    pytest_collection_modifyitems: xdist's own hook reads the marks."""
    groups = {}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item, one_worker)))
        marker = item.get_closest_marker("xdist_group")
        assert marker is not None
        groups[item.nodeid] = str(marker.args[0] if marker.args else marker.kwargs.get("name", ""))
    sizes = Counter(groups.values())
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(groups[item.nodeid], i)

    def order(item: pytest.Item) -> tuple[int, int, int]:
        group = groups[item.nodeid]
        rank = next((i for i, prefix in enumerate(long_first) if group.startswith(prefix)), len(long_first))
        return rank, -sizes[group], first_seen[group]

    items[:] = sorted(items, key=order)
