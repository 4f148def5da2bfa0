"""Which tests share an xdist worker in ./dev test's parallel pass
(--dist loadgroup): a module's tests stay together, so module-scoped
fixtures are set up once (what --dist loadfile does), and the folders below
share one worker besides."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

# The real cluster's package-scoped fixture; the two netns cluster modules
# each bring up to 8 cgpuds, and one such cluster at a time is enough for
# two cores.
ONE_WORKER = ("tests/realkube/", "tests/e2e/test_cluster")


def group_by_module(items: Sequence[pytest.Item], one_worker: Sequence[str] = ONE_WORKER) -> None:
    """Marks every test without an xdist_group with its module's (or its
    ONE_WORKER prefix's) group. Call it from a tryfirst
    pytest_collection_modifyitems: xdist's own hook reads the marks."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(next((d for d in one_worker if module.startswith(d)), module)))
