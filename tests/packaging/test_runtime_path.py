"""`cgpuctl runtime configure`'s default path: the package's stable link
when it leads to this very cgpu-runtime, else the installed file."""

from __future__ import annotations

import shutil
from pathlib import Path

from cgpud.cli.runtime_configure import default_runtime_path
from cgpud.native import native_path
import pytest

pytestmark = pytest.mark.slow  # tens of seconds to minutes each


def test_the_stable_link_is_named_only_when_it_leads_here(tmp_path: Path) -> None:
    native = native_path("bin/cgpu-runtime")
    link = tmp_path / "cgpu-runtime"
    link.symlink_to(native)
    assert default_runtime_path(link) == link
    other = tmp_path / "other"
    shutil.copy2(native, other)  # the same bytes, but another install's file
    link.unlink()
    link.symlink_to(other)
    assert default_runtime_path(link) == native
    link.unlink()
    assert default_runtime_path(link) == native  # no link: a pip or source install
