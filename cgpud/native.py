"""Where the C parts built by `pip install` live inside the package."""

from __future__ import annotations

from pathlib import Path


from cgpud.errors import CgpuError


class NativePartMissing(CgpuError):
    """A C part was not built; reinstall with `pip install .`."""


def native_dir() -> Path:
    return Path(__file__).resolve().parent / "_native"


def native_path(relative: str) -> Path:
    path = native_dir() / relative
    if not path.exists():
        raise NativePartMissing(
            f"{path} is missing: the C parts were not built; run `pip install .` in the source tree"
        )
    return path
