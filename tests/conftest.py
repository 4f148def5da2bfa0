"""Fixtures shared by every test: the built native parts and a private
simulated machine per test, so tests never see each other's GPU state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.native import native_dir
from tests.harness.sim import region_mounts, sim_env_in
from tests.harness.xdist_groups import group_by_module


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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_by_module(items)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The README blocks this run ran (tests/harness/readme.py), and how each ended."""
    ran = [
        (value, r.outcome, r.nodeid)
        for outcome in ("passed", "failed")
        for r in terminalreporter.stats.get(outcome, [])
        if r.when == "call"
        for name, value in r.user_properties
        if name == "readme_block"
    ]
    if ran:
        terminalreporter.section("README blocks run")
        for where, outcome, nodeid in sorted(ran):
            terminalreporter.write_line(f"{where}  {outcome}  {nodeid.split('::')[0]}")
