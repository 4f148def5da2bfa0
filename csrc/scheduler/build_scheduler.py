"""cffi out-of-line API build of the scheduler core and its engine as
cgpud._scheduler. The declarations come from the headers themselves, so they
cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def _cdef_from_header(header: Path) -> str:
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.DOTALL)
    keep = []
    for line in text.splitlines():
        stripped = line.strip()
        if re.fullmatch(r"#define \w+ \d+", stripped) or (stripped and not stripped.startswith("#")):
            keep.append(stripped)
    return "\n".join(keep) + "\n"


ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header(HERE / "scheduler.h") + _cdef_from_header(HERE / "engine.h"))
ffibuilder.set_source(
    "cgpud._scheduler",
    '#include "scheduler.h"\n#include "engine.h"',
    # setuptools wants sources relative to setup.py, which sits two levels up.
    # guard.c: this module's own SIGBUS guard for the usage files it maps;
    # hidden, so it never binds to the region module's copy.
    sources=[
        "csrc/scheduler/scheduler.c",
        "csrc/scheduler/engine.c",
        "csrc/region/region_file.c",
        "csrc/region/guard.c",
    ],
    include_dirs=[str(HERE), str(HERE.parent / "include"), str(HERE.parent / "region")],
    libraries=["pthread"],
    extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
