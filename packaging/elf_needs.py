"""The glibc symbol versions ELF files need, read as auditwheel reads them:
from each file's version-needs section (.gnu.version_r), not from strings
that merely look like versions.

    python packaging/elf_needs.py DIR     the newest GLIBC_ version any ELF
                                          file under DIR needs, and which

build.py takes the package's glibc floor from here; tests/packaging checks
both packages' files with it."""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

SHT_GNU_VERNEED = 0x6FFFFFFE
GLIBC_LIBRARIES = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2")


class ElfError(ValueError):
    pass


def version_needs(data: bytes) -> dict[str, set[str]]:
    """Library soname -> the symbol versions this ELF file needs of it.
    Only 64-bit little-endian files (what the packages hold)."""
    if data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needs: dict[str, set[str]] = {}
    for _name, kind, _flags, _addr, offset, _size, link, info, _align, _entsize in sections:
        if kind != SHT_GNU_VERNEED:
            continue
        strings = sections[link][4]
        at = offset
        for _ in range(info):  # sh_info: how many Verneed entries
            _version, count, file, aux, following = struct.unpack_from("<HHIII", data, at)
            names = needs.setdefault(_string(data, strings + file), set())
            entry = at + aux
            for _ in range(count):
                _hash, _vflags, _other, name, next_aux = struct.unpack_from("<IHHII", data, entry)
                names.add(_string(data, strings + name))
                entry += next_aux
            if not following:
                break
            at += following
    return needs


def _string(data: bytes, at: int) -> str:
    return data[at : data.index(b"\0", at)].decode()


def glibc_version(needs: dict[str, set[str]]) -> tuple[int, ...] | None:
    """The newest GLIBC_x.y[.z] version among the needs of glibc's libraries."""
    found = [
        tuple(int(n) for n in v.removeprefix("GLIBC_").split("."))
        for lib, versions in needs.items()
        if lib in GLIBC_LIBRARIES
        for v in versions
        if v.startswith("GLIBC_") and v[6:7].isdigit()
    ]
    return max(found) if found else None


def elf_files(root: Path) -> list[Path]:
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        if not (path.suffix == ".so" or ".so." in path.name or os.access(path, os.X_OK)):
            continue
        with open(path, "rb") as f:
            if f.read(4) == b"\x7fELF":
                found.append(path)
    return found


def newest_glibc(root: Path) -> tuple[tuple[int, ...], list[Path]]:
    """The newest glibc version any ELF file under root needs, and the files that need it."""
    by_file = {path: glibc_version(version_needs(path.read_bytes())) for path in elf_files(root)}
    versions = [v for v in by_file.values() if v is not None]
    if not versions:
        raise ElfError(f"no ELF file under {root} needs a GLIBC_ version")
    newest = max(versions)
    return newest, [p for p, v in by_file.items() if v == newest]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: elf_needs.py DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    newest, files = newest_glibc(root)
    print(f"GLIBC_{'.'.join(map(str, newest))}")
    for path in files:
        print(f"  {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
