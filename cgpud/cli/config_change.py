"""What `cgpuctl runtime configure` plans: the runtime to register and the
file changes that register it, planned as text so a dry run prints the plan."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RuntimeSpec:
    """The runtime to register: its name in the engine and the shim it runs."""

    name: str
    path: Path
    set_as_default: bool = False


@dataclass(frozen=True)
class FileChange:
    """One file's text before (None: it does not exist) and after."""

    path: Path
    old: str | None
    new: str
    backup: bool = True
    mode: int | None = None  # None: keep an existing file's mode, 0644 for a new one

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def diff(self) -> str:
        lines = difflib.unified_diff(
            (self.old or "").splitlines(keepends=True),
            self.new.splitlines(keepends=True),
            fromfile=str(self.path),
            tofile=f"{self.path} (cgpu)",
        )
        # A last line without a newline would run into the next file's header.
        return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
