"""cgpu: node-local GPU sharing and isolation runtime."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # __version__ on first use: importlib.metadata is a tenth of every
    # cgpuctl call, and most calls never print a version.
    if name != "__version__":
        raise AttributeError(f"module 'cgpud' has no attribute {name!r}")
    from importlib import metadata

    try:
        return metadata.version("cgpud")
    except metadata.PackageNotFoundError:  # imported from a source tree without install
        return "0+unknown"
