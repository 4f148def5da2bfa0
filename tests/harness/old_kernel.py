"""Older kernels, played on this one: `old_kernel.c` under a seccomp filter
that answers ENOSYS to every x86_64 system call an older kernel lacks.

On x86_64 a new system call always takes the next number, so a kernel is its
table's last number: 4.18 (RHEL 8, Rocky 8) ends at rseq (334); 3.10 (CentOS
7) at finit_module (313). What the filter cannot play: calls a distribution
backported to its old kernel (RHEL 7 has a few); those are then present, so
a path that works without them still works."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.builds import built
from tests.harness.cc import compile_strict

SOURCE = Path(__file__).with_name("old_kernel.c")


@dataclass(frozen=True)
class OldKernel:
    name: str  # as `uname -r` starts
    last_syscall: int  # the highest x86_64 system call number it has
    lacks: str  # what cgpu uses that it lacks, for test ids and messages

    def argv(self, launcher: Path, *command: str) -> list[str]:
        return [str(launcher), str(self.last_syscall), *command]


RHEL8 = OldKernel("4.18", 334, "pidfd_open, pidfd_send_signal, clone3, close_range, openat2")
CENTOS7 = OldKernel("3.10", 313, "also statx, getrandom, memfd_create, renameat2, copy_file_range")
KERNELS = (RHEL8, CENTOS7)


def launcher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The old-kernel launcher, built once per run."""
    out = built(tmp_path_factory, "old-kernel", lambda d: compile_strict(d / "old-kernel", str(SOURCE)))
    return out / "old-kernel"
