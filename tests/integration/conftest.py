"""Fixtures for the integration tests that talk to cgpud as a process."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.daemon import Daemon, running_daemon


@pytest.fixture
def daemon(tmp_path: Path, sim_env: dict[str, str]) -> Iterator[Daemon]:
    """A started cgpud on the test's simulated GPUs, stopped cleanly after."""
    with running_daemon(tmp_path, sim_env) as d:
        yield d
