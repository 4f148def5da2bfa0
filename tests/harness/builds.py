"""Builds the tests share, made once per run: by whichever xdist worker asks
first, the others waiting on a lock, and, under `./dev test`, once for both
of its passes (it names a directory for the run in $CGPU_TEST_BUILDS and
removes it at the end). Under plain pytest, once per session."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness.wait import until

RUN_DIR_ENV = "CGPU_TEST_BUILDS"
# The longest build (the packages, or the sanitized C parts on a busy
# machine) takes minutes; a waiter gives up after this.
WAIT_S = 1200.0


def _root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    named = os.environ.get(RUN_DIR_ENV)
    if named:
        return Path(named)
    base = tmp_path_factory.getbasetemp()
    # xdist gives each worker base/../popen-gwN: the parent is the session's.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `build` filled for `name` in this run, built now if no
    one has. A build that failed is tried again by the next asker."""
    root = _root(tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        until(lambda: _locked(lock.fileno()), WAIT_S, interval=0.2, what=f"the {name} build of another worker")
        try:
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                build(out)
                done.touch()
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return out


def _locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
