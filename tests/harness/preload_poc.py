"""The NVIDIAScape pattern's payload: a shared library that, if it ever runs,
leaves a marker file where it ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

POC_SOURCE = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void poc(void) {
    int fd = open(MARKER, O_CREAT | O_WRONLY, 0644);
    if (fd >= 0) close(fd);
}
"""


def build_poc(where: Path, marker: Path) -> Path:
    src = where / "poc.c"
    src.write_text(POC_SOURCE)
    out = where / "poc.so"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(out), str(src)], check=True)
    return out
