"""Fixtures for the relay tests: every test runs against the release build
and against an AddressSanitizer/UBSan build of the relays, built once per
session for all the modules here."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness import sanitizers
from tests.harness.relay import Cgpud, FakeRuntime, closed_after, relay_env
from tests.harness.sanitizers import SAN_OPTIONS


@pytest.fixture(scope="session", params=["release", "sanitize"])
def bins(request, native: Path, tmp_path_factory) -> Path:
    if request.param == "release":
        return native / "bin"
    return sanitizers.shared_build(tmp_path_factory) / "bin"  # the relays of the one sanitized build


@pytest.fixture
def sock_path() -> Iterator[Path]:
    # pytest's tmp_path can be longer than a unix socket address allows.
    short = Path(tempfile.mkdtemp(prefix="cgpu-relay-", dir="/tmp"))
    yield short / "relay.sock"
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def cgpud(sock_path: Path) -> Iterator[Callable[..., Cgpud]]:
    def answering(answer: bytes | None = b"ok\n") -> Cgpud:
        return Cgpud(sock_path, answer)

    with closed_after(answering) as start:
        yield start


@pytest.fixture
def runtime(tmp_path: Path) -> FakeRuntime:
    (tmp_path / "rt").mkdir()
    return FakeRuntime(tmp_path / "rt" / "fake-runc")


@pytest.fixture
def env(runtime: FakeRuntime, sock_path: Path) -> dict[str, str]:
    return relay_env(runtime.path, sock_path)


@pytest.fixture
def hook_env() -> dict[str, str]:
    """What runc gives a hook whose entry has an empty env (and no waiting
    for a cgpud that is down: test_relay_wait.py waits)."""
    return {**SAN_OPTIONS, "CGPU_RELAY_WAIT_MS": "0"}
