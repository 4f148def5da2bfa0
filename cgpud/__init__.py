"""cgpu: node-local GPU sharing and isolation runtime."""

from __future__ import annotations

from importlib import metadata


def _version() -> str:
    try:
        return metadata.version("cgpud")
    except metadata.PackageNotFoundError:  # imported from a source tree without install
        return "0+unknown"


__version__ = _version()
