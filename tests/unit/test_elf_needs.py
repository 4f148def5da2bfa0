"""packaging/elf_needs.py against objdump's reading of the same files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.cc import build_c

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packaging"))
import elf_needs


def objdump_needs(path: Path) -> dict[str, set[str]]:
    out = subprocess.run(["objdump", "-p", str(path)], capture_output=True, text=True, check=True).stdout
    needs: dict[str, set[str]] = {}
    lib = None
    for line in out.split("Version References:")[1].splitlines():
        if m := re.match(r"\s+required from (\S+):", line):
            lib = m.group(1)
            needs[lib] = set()
        elif (m := re.match(r"\s+0x[0-9a-f]+ 0x[0-9a-f]+ \d+ (\S+)", line)) and lib:
            needs[lib].add(m.group(1))
    return needs


SOURCE = r"""
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[0], RTLD_NOW);
    printf("%p %f\n", h, sqrt((double)argc));
    return 0;
}
"""


@pytest.mark.parametrize("flags", [(), ("-shared", "-fPIC")], ids=["program", "shared object"])
def test_it_reads_what_objdump_reads(tmp_path: Path, flags: tuple[str, ...]) -> None:
    built = build_c(tmp_path, SOURCE, "needs", *flags, "-lm")
    needs = elf_needs.version_needs(built.read_bytes())
    assert needs == objdump_needs(built)
    assert "libc.so.6" in needs
    assert elf_needs.glibc_version(needs) == max(
        tuple(int(n) for n in v[6:].split(".")) for v in needs["libc.so.6"] | needs.get("libm.so.6", set())
    )


def test_the_newest_version_of_a_tree_and_its_files(tmp_path: Path) -> None:
    build_c(tmp_path, SOURCE, "needs", "-lm")
    (tmp_path / "notes.txt").write_text("GLIBC_2.99 in a text file is no need")
    newest, files = elf_needs.newest_glibc(tmp_path)
    assert newest < (2, 99) and files == [tmp_path / "needs"]


def test_what_is_not_a_64_bit_elf_file_is_refused() -> None:
    with pytest.raises(elf_needs.ElfError, match="not an ELF file"):
        elf_needs.version_needs(b"#!/bin/sh\n")
    with pytest.raises(elf_needs.ElfError, match="64-bit little-endian"):
        elf_needs.version_needs(b"\x7fELF\x01\x01" + bytes(58))
