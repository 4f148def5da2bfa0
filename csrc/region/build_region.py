"""cffi out-of-line API build of the region operations as cgpud._region.

The declarations are derived from the headers themselves (the layout in
include/cgpu/region.h, the relay protocol's constants in
include/cgpu/relay_wire.h, the operations in region_ops.h, the ones only cgpud
needs in region_cgpud.h), so Python and C cannot drift. Every constant's
value comes from the C compiler: plain integers stay `#define NAME N` (cffi
needs them to size arrays and checks them against C at import), the rest
become `static const T NAME;` read from C."""

from __future__ import annotations

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
INCLUDE = HERE.parent / "include"
HEADERS = (
    INCLUDE / "cgpu" / "region.h",
    INCLUDE / "cgpu" / "relay_wire.h",
    HERE / "region_ops.h",
    HERE / "region_cgpud.h",
    HERE / "guard.h",
)

# cffi does not parse _Atomic. The plain integer types have the same size and
# alignment (asserted in region_cgpud.c), so the layout cffi computes is right.
ATOMIC_MACRO = "CGPU_ATOMIC"

_DEFINE = re.compile(r"#\s*define\s+(\w+)(\(.*?\))?(?:\s+(.*))?")
_PLAIN_INT = re.compile(r"(0x[0-9a-fA-F]+|\d+)")
_SUFFIXED_INT = re.compile(r"(0x[0-9a-fA-F]+|\d+)[uU]?[lL]{1,2}[uU]?|(0x[0-9a-fA-F]+|\d+)[uU]")
_STRING = re.compile(r'"[^"\\]*"')


class HeaderError(RuntimeError):
    """A header holds a macro this script does not know how to declare."""


def _macro_decl(name: str, params: str | None, value: str | None) -> str | None:
    """The cdef line for one #define, or None when Python has no use for it."""
    if params is not None or value is None or name == ATOMIC_MACRO:
        return None  # function-like macros, include guards, the atomic qualifier
    if _PLAIN_INT.fullmatch(value):
        return f"#define {name} {value}"
    if _SUFFIXED_INT.fullmatch(value):
        return f"static const uint64_t {name};"
    if _STRING.fullmatch(value):
        return f"static const char *const {name};"
    # Fail the build rather than silently leave a constant out of Python.
    raise HeaderError(f"cannot declare macro {name} = {value!r} for cffi; teach build_region.py")


def cdef_from_header(header: Path) -> str:
    text = header.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", "", text)
    text = text.replace("\\\n", " ")
    keep: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            m = _DEFINE.fullmatch(stripped)
            decl = _macro_decl(m.group(1), m.group(2), (m.group(3) or "").strip() or None) if m else None
            if decl is not None:
                keep.append(decl)
            continue
        keep.append(re.sub(rf"\b{ATOMIC_MACRO}\b", "", stripped))
    return "\n".join(keep) + "\n"


ffibuilder = FFI()
ffibuilder.cdef("".join(cdef_from_header(h) for h in HEADERS))
ffibuilder.set_source(
    "cgpud._region",
    # The wrapper sees the same plain-integer layout as the cdef, so cffi's
    # generated field checks compile; region.c and region_cgpud.c keep _Atomic.
    f"#define {ATOMIC_MACRO}\n"
    '#include "region_ops.h"\n#include "region_cgpud.h"\n#include "guard.h"\n'
    '#include "cgpu/relay_wire.h"\n',
    # setuptools wants sources relative to setup.py, which sits two levels up.
    # guard.c: this module's own SIGBUS guard for the usage files cgpud maps;
    # hidden, so it never binds to the scheduler module's copy.
    sources=["csrc/region/region.c", "csrc/region/region_cgpud.c", "csrc/region/guard.c"],
    include_dirs=[str(HERE), str(INCLUDE)],
    extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
)

if __name__ == "__main__":
    print(ffibuilder._cdefsources[0])  # the derived cdef, for review
