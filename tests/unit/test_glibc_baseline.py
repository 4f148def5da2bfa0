"""libcgpu.so loads into images whose glibc is as old as 2.17: ld.so skips a
preload that needs a symbol version the image's libc lacks, and the
container then runs without limits. objdump and readelf read what the
dynamic linker will ask for."""

from __future__ import annotations

import re
import subprocess

from cgpud.native import native_path

FLOOR = (2, 17)


def _tool(*cmd: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_libcgpu_needs_no_glibc_version_newer_than_2_17() -> None:
    lib = str(native_path("lib/libcgpu.so"))
    needs = re.findall(r"Name: GLIBC_(\d+)\.(\d+)", _tool("readelf", "-V", "-W", lib))
    assert needs, "readelf listed no GLIBC_ version needs: is libcgpu.so linked against glibc?"
    too_new = sorted({(int(a), int(b)) for a, b in needs if (int(a), int(b)) > FLOOR})
    imports = _tool("objdump", "-T", lib)
    culprits = [line.split()[-1] for line in imports.splitlines() if any(f"GLIBC_{a}.{b}" in line for a, b in too_new)]
    assert not too_new, f"libcgpu.so needs glibc {too_new} for {culprits}: pin them in glibc_baseline.h"


def test_libcgpu_links_libdl_and_libpthread_for_images_before_glibc_2_34() -> None:
    # Before 2.34, dlopen and pthread_create live there, not in libc.so.6.
    dynamic = _tool("readelf", "-d", str(native_path("lib/libcgpu.so")))
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert {"libdl.so.2", "libpthread.so.0", "libc.so.6"} <= needed, needed
