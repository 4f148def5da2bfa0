"""Fixtures for the integration tests that talk to cgpud as a process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import sanitizers
from tests.harness.daemon import Daemon, running_daemon


@pytest.fixture
def daemon(tmp_path: Path, sim_env: dict[str, str]) -> Iterator[Daemon]:
    """A started cgpud on the test's simulated GPUs, stopped cleanly after."""
    with running_daemon(tmp_path, sim_env) as d:
        yield d


@pytest.fixture(scope="session")
def san_native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every C part built with ASan and UBSan: once per run, for every
    module that runs sanitized code (a build takes minutes here)."""
    return sanitizers.shared_build(tmp_path_factory)


@pytest.fixture
def san_env(sim_env: dict[str, str], san_native: Path) -> dict[str, str]:
    return sanitizers.san_env(sim_env, san_native)


@pytest.fixture
def san_instance(san_env: dict[str, str], san_native: Path, tmp_path: Path) -> dict[str, str]:
    """The sanitized workload in an instance enforced by the sanitized libcgpu.so."""
    return sanitizers.instance_env(san_env, san_native, tmp_path / "region")
