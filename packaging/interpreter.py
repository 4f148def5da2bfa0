"""The CPython the packages bundle: built from Debian's source packages
with zig (zig.py) for glibc 2.17, with the libraries its standard library
needs (OpenSSL, SQLite, libffi, zlib, bzip2, xz) linked in statically, so the
packages need nothing of the target system but glibc.

The interpreter is static (no libpython.so: nothing to relocate) and finds
its standard library beside itself, so the tree can be copied anywhere.
It is built once, into a cache outside the clone keyed by this recipe
(cache_root()/cpython-<...>/); BUILT-FROM there lists the source versions.

    python packaging/interpreter.py      # build it (or find it) and print its prefix
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from elf_needs import elf_files
from zig import GLIBC_FLOOR, ZIG_VERSION, Zig, cache_root
from zig import install as install_zig

PYTHON_SOURCE = "python3.11"
PYVER = "python3.11"
# Bump when a step below changes: the cache is keyed by it.
RECIPE = 2
KEY = f"cpython-3.11-glibc{GLIBC_FLOOR}-zig{ZIG_VERSION}-r{RECIPE}"
DEBIAN_SOURCES = (
    "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main\n"
    "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]"
    " http://deb.debian.org/debian-security bookworm-security main\n"
)
# Lines of the build's own output kept in an error message.
TAIL = 3000


class InterpreterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Library:
    """One static library the standard library links: its Debian source
    package, and the shell steps that build it from the unpacked upstream
    tree into {deps} ({jobs}: parallel make jobs)."""

    source: str
    steps: tuple[str, ...]


LIBRARIES = (
    Library("zlib", ("./configure --static --prefix={deps}", "make -j{jobs} libz.a", "make install")),
    Library(
        "bzip2",
        (
            'make -j{jobs} libbz2.a CC="$CC" AR="$AR" RANLIB="$RANLIB" CFLAGS="$CFLAGS -D_FILE_OFFSET_BITS=64"',
            "mkdir -p {deps}/lib {deps}/include && cp libbz2.a {deps}/lib/ && cp bzlib.h {deps}/include/",
        ),
    ),
    Library(
        "xz-utils",
        (
            "./configure --prefix={deps} --disable-shared --enable-static --disable-xz --disable-xzdec"
            " --disable-lzmadec --disable-lzmainfo --disable-scripts --disable-doc --disable-nls",
            "make -j{jobs}",
            "make install",
        ),
    ),
    Library(
        "libffi",
        (
            # Its static trampolines need a function glibc 2.17's headers lack.
            "./configure --prefix={deps} --disable-shared --enable-static --disable-docs"
            " --disable-multi-os-directory --disable-exec-static-tramp",
            "make -j{jobs}",
            "make install",
        ),
    ),
    Library(
        "sqlite3",
        (
            "./configure --prefix={deps} --disable-shared --enable-static --disable-tcl --disable-readline"
            " --disable-editline",
            "make -j{jobs} libsqlite3.la",
            "cp .libs/libsqlite3.a {deps}/lib/ && cp sqlite3.h sqlite3ext.h {deps}/include/",
        ),
    ),
    Library(
        "openssl",
        (
            # Only what _ssl and _hashlib use. The system's CA store is found
            # where Debian and Ubuntu keep it (RHEL links /etc/ssl/certs too).
            "./Configure linux-x86_64 no-shared no-tests no-engine no-module no-legacy no-comp"
            " --prefix={deps} --libdir=lib --openssldir=/etc/ssl -fPIC -O2",
            "make -j{jobs} build_libs >/dev/null",
            "make install_dev >/dev/null",
        ),
    ),
)

# Where CPython's configure finds each library (the static archives need
# their own dependencies named: pkg-config's non-static answers do not).
CONFIGURE_LIBS = {
    "LIBSQLITE3_LIBS": "-lsqlite3 -lm -lpthread",
    "LIBFFI_LIBS": "-lffi",
    "ZLIB_LIBS": "-lz",
    "BZIP2_LIBS": "-lbz2",
    "LIBLZMA_LIBS": "-llzma",
}


@dataclass(frozen=True)
class Interpreter:
    """A finished build: bin/python3.11 and lib/python3.11 under prefix."""

    prefix: Path

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / PYVER

    @property
    def include(self) -> Path:
        return self.prefix / "include" / PYVER

    @property
    def stdlib(self) -> Path:
        return self.prefix / "lib" / PYVER


def _sh(step: str, cwd: Path, env: dict[str, str], log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ (cd {cwd} && {step})\n")
        out.flush()
        proc = subprocess.run(["sh", "-ec", step], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise InterpreterError(f"`{step}` in {cwd} failed ({proc.returncode}):\n{log.read_text()[-TAIL:]}")


def fetch_sources(dest: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """The upstream tarballs of Debian's source packages `names`, fetched
    with apt-get against a sources list and package lists of our own (the
    machine's apt configuration is neither read nor changed)."""
    apt = dest / "apt"
    (apt / "lists" / "partial").mkdir(parents=True)
    (apt / "sources.list").write_text(DEBIAN_SOURCES)
    options = [
        "-o",
        f"Dir::Etc::sourcelist={apt / 'sources.list'}",
        "-o",
        "Dir::Etc::sourceparts=-",
        "-o",
        f"Dir::State::Lists={apt / 'lists'}",
        "-o",
        "APT::Get::List-Cleanup=0",
        "-o",
        "APT::Sandbox::User=root",
    ]
    for args in (["update", "-qq"], ["source", "-qq", "--download-only", "--tar-only", *names]):
        proc = subprocess.run(["apt-get", *options, *args], cwd=dest, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise InterpreterError(f"apt-get {args[0]} of Debian's sources failed:\n{proc.stderr[-TAIL:]}")
    tarballs = {}
    for name in names:
        found = [p for p in dest.glob(f"{name}_*.orig.tar.*") if not p.name.endswith(".asc")]
        if len(found) != 1:
            raise InterpreterError(f"expected one upstream tarball of {name}, found {[p.name for p in found]}")
        tarballs[name] = found[0]
    return tarballs


def _unpack(tarball: Path, into: Path) -> Path:
    before = set(into.iterdir())
    shutil.unpack_archive(tarball, into)
    [tree] = set(into.iterdir()) - before
    return tree


def _environment(zig: Zig, deps: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CFLAGS", "LDFLAGS", "CPPFLAGS"))}
    env.update(zig.environment())
    env.update(
        {
            "CFLAGS": "-O2 -fPIC",
            # Nothing of this machine's libraries: only what is built here.
            "PKG_CONFIG_PATH": str(deps / "lib" / "pkgconfig"),
            "PKG_CONFIG_LIBDIR": str(deps / "lib" / "pkgconfig"),
        }
    )
    return env


def _build_python(tree: Path, prefix: Path, deps: Path, env: dict[str, str], jobs: int, log: Path) -> None:
    env = dict(env)
    env.update(
        {
            "CPPFLAGS": f"-I{deps / 'include'}",
            "LDFLAGS": f"-L{deps / 'lib'}",
            # zig's clang refuses __DATE__ by default (reproducible builds);
            # -g off: debug info would triple the package.
            "CFLAGS": "-Wno-date-time",
            "OPT": "-DNDEBUG -fwrapv -O3 -Wall",
        }
    )
    for var, libs in CONFIGURE_LIBS.items():
        env[var] = f"-L{deps / 'lib'} {libs}"
        env[var.replace("_LIBS", "_CFLAGS")] = f"-I{deps / 'include'}"
    # setup.py adds the build machine's /usr/include/<multiarch> for the
    # extension modules, whose glibc headers clash with zig's; and with
    # _PYTHON_HOST_PLATFORM set it adds no /usr/local or /usr either.
    setup_py = tree / "setup.py"
    text, n = re.subn(
        r"^        self\.add_multiarch_paths\(\)$", "        pass", setup_py.read_text(), flags=re.MULTILINE
    )
    if n != 1:
        raise InterpreterError(f"{setup_py}: add_multiarch_paths() call not found; update the recipe")
    setup_py.write_text(text)
    env["_PYTHON_HOST_PLATFORM"] = "linux-x86_64"
    for step in (
        f"./configure --prefix={prefix} --with-openssl={deps} --with-openssl-rpath=no --without-ensurepip"
        " --with-system-ffi --disable-test-modules",
        f"make -j{jobs}",
        "make install",
    ):
        _sh(step, tree, env, log)


def _check(interp: Interpreter) -> None:
    """The modules cgpud needs were built (setup.py only warns when one is not)."""
    needed = "ssl, sqlite3, ctypes, zlib, bz2, lzma, hashlib, decimal, json, select, mmap, fcntl"
    proc = subprocess.run([str(interp.python), "-I", "-c", f"import {needed}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InterpreterError(f"the built interpreter lacks a module cgpud needs: {proc.stderr.strip()[-TAIL:]}")


def build(root: Path, jobs: int) -> None:
    """Everything, into `root` (which does not exist yet)."""
    zig = install_zig()
    with tempfile.TemporaryDirectory(prefix="cgpu-cpython-") as tmp:
        work = Path(tmp)
        log = work / "build.log"
        names = (PYTHON_SOURCE, *(lib.source for lib in LIBRARIES))
        tarballs = fetch_sources(work / "sources", names)
        deps = work / "deps"
        env = _environment(zig, deps)
        for lib in LIBRARIES:
            tree = _unpack(tarballs[lib.source], work)
            for step in lib.steps:
                _sh(step.format(deps=deps, jobs=jobs), tree, env, log)
        _build_python(_unpack(tarballs[PYTHON_SOURCE], work), root, deps, env, jobs, log)
        # zig cc emits debug info by default: most of the interpreter's
        # bytes (13 MB of its 18, 11 of _ssl's 16), which no user reads.
        for path in elf_files(root):
            _sh(f"strip --strip-debug '{path}'", root, env, log)
    _check(Interpreter(root))
    (root / "BUILT-FROM").write_text("".join(f"{p.name}\n" for p in tarballs.values()) + f"ziglang {ZIG_VERSION}\n")


def install(jobs: int | None = None) -> Interpreter:
    """The cached interpreter, building it first if it is not there."""
    cache = cache_root()
    root = cache / KEY
    if (root / ".complete").is_file():
        return Interpreter(root)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock-cpython", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").is_file():
            return Interpreter(root)
        if root.exists():
            shutil.rmtree(root)  # an interrupted build
        try:
            build(root, jobs or os.cpu_count() or 1)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        (root / ".complete").touch()
    return Interpreter(root)


def main() -> int:
    try:
        print(install().prefix)
    except (InterpreterError, OSError) as e:
        print(f"interpreter: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
