"""Fixtures shared by every test: the built native parts and a private
simulated machine per test, so tests never see each other's GPU state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.native import native_dir
from tests.harness.sim import region_mounts, sim_env_in


@pytest.fixture(scope="session")
def native() -> Path:
    """Directory of the built C parts: sim/, bin/, lib/."""
    return native_dir()


@pytest.fixture
def sim_env(tmp_path: Path, native: Path) -> dict[str, str]:
    """Environment for a subprocess that should see a fresh simulated machine
    of 2 GPUs with 16 GiB each."""
    return sim_env_in(tmp_path, native)


@pytest.fixture(scope="module", autouse=True)
def _no_region_mounts_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """cgpud keeps an instance's tmpfs across its own restarts, as it
    should; the daemons of a test module leave theirs behind when the
    module ends, and they are detached here, not left on the host."""
    yield
    from cgpud._region import lib

    for point in region_mounts(tmp_path_factory.getbasetemp()):
        lib.cgpu_region_unmount(point.encode())


# Tests that share an expensive package- or session-scoped fixture stay on
# one xdist worker: another worker would build the same cluster or packages
# again; the two netns cluster modules each bring up to 8 cgpuds, one such
# cluster at a time is enough for two cores. Every other module is a group of
# its own, so module-scoped fixtures are set up once too (what --dist loadfile
# does, with these groups on top).
_ONE_WORKER = ("tests/realkube/", "tests/packaging/", "tests/e2e/test_cluster")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(next((d for d in _ONE_WORKER if module.startswith(d)), module)))
