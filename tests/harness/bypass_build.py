"""Builds of the hostile tenants that go around libcgpu.so, for tests and
benchmarks. Test-only: unlike csrc/tools/cgpu_bypass.c, this knows the GPU is
the simulated one.

API (stable; tests/harness/bypass_watch.py, tests/e2e and bench/ use it):
  elf_bypass()         cgpu-bypass as build_native.py builds it into
                       cgpud/_native: run it with `--resolve elf` (finds the
                       driver's entry points in its symbol table, no dlsym).
  static_bypass()      `gcc -static` of cgpu-bypass with the simulated driver
                       linked in; run with `--resolve link`. No ld.so, so no
                       preload; the simulation's stand-in for a tenant that
                       drives the device files itself.
  musl_libcuda()       the simulated libcuda.so.1 built with musl-gcc (the
                       driver library a musl image would ship).
  musl_bypass()        cgpu-bypass built with musl-gcc against it; run with
                       `--resolve link`. Its loader ignores /etc/ld.so.preload
                       and cannot load the glibc-built libcgpu.so, so under
                       `cgpuctl run` it must run with LD_PRELOAD removed.
  musl_host_env()      ["LD_LIBRARY_PATH=..."]: what `env` needs on the host
                       for musl_bypass() to find musl_libcuda() (the test
                       environment's LD_LIBRARY_PATH names the glibc one).
  musl_rootfs(dest)    adds to the rootfs `dest` (made with a busybox by
                       tests/e2e/oci.build_rootfs when it does not exist):
                       /lib/ld-musl-x86_64.so.1, the musl libcuda in
                       /usr/lib/musl, the tenant as /usr/bin/cgpu-bypass and
                       /etc/ld-musl-x86_64.path; returns dest.
  MUSL_ENV             the process env entries the container also gets.
  MUSL_TENANT          where musl_rootfs puts the tenant inside.

Every build is cached under build/bypass/<hash of its inputs>/ (ignored by
git), so sessions and processes share it and a changed source rebuilds. A
missing compiler is an AssertionError saying what to install: the tests fail,
they do not skip (./dev test installs musl-tools)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from cgpud.native import native_path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
sys.path.insert(0, str(CSRC))
from build_native import TARGETS, NativeBuildError, Target, Variant, compile_target  # noqa: E402

CACHE = ROOT / "build" / "bypass"
MUSL_LOADER = Path("/lib/ld-musl-x86_64.so.1")
MUSL_LIB_DIR = "/usr/lib/musl"
MUSL_TENANT = "/usr/bin/cgpu-bypass"
MUSL_ENV = (f"LD_LIBRARY_PATH={MUSL_LIB_DIR}",)
# musl-gcc searches only musl's headers; the simulated driver needs the
# kernel's (linux/futex.h), so a directory of links to them goes after.
KERNEL_HEADERS = {
    "linux": "/usr/include/linux",
    "asm-generic": "/usr/include/asm-generic",
    "asm": "/usr/include/x86_64-linux-gnu/asm",
}


def _inputs_hash(*extra: str) -> str:
    """Of every source a build may read, so an edit anywhere rebuilds."""
    h = hashlib.sha256()
    files = sorted(
        [
            *(CSRC / "simgpu").glob("*.[ch]"),
            *(CSRC / "include").rglob("*"),
            CSRC / "tools/cgpu_bypass.c",
            CSRC / "build_native.py",
            Path(__file__),
        ]
    )
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    for e in extra:
        h.update(e.encode() + b"\0")
    return h.hexdigest()[:16]


def _cached(name: str, build: Callable[[Path], Path], *key: str) -> Path:
    """build(tmp) writes into a fresh directory, renamed into place whole, so
    concurrent test processes never see half a build."""
    final = CACHE / f"{name}-{_inputs_hash(name, *key)}"
    if not final.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
        try:
            rel = build(tmp).relative_to(tmp)
            (tmp / "OUTPUT").write_text(str(rel))
            try:
                tmp.rename(final)
            except OSError:  # another process got there first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final / (final / "OUTPUT").read_text()


def _need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    assert path, f"{tool} not found: install {package} (./dev test installs it as root)"
    return path


def _compile(target: Target, out: Path, variant: Variant, cc: str | None = None) -> Path:
    try:
        return compile_target(target, out, variant, cc=cc)
    except NativeBuildError as e:
        raise AssertionError(f"{e}\n(static builds need libc6-dev's libc.a; musl builds need musl-tools)") from None


def _sim_driver() -> Target:
    [lib] = [t for t in TARGETS if t.output == "sim/libcuda.so.1"]
    return lib


def elf_bypass() -> Path:
    """The tool as shipped in cgpud/_native (it must work on a real GPU)."""
    path = native_path("bin/cgpu-bypass")
    assert path.exists(), f"{path} is missing: rebuild with `python csrc/build_native.py cgpud/_native`"
    return path


def static_bypass() -> Path:
    _need(os.environ.get("CC") or "cc", "gcc and libc6-dev")

    def build(tmp: Path) -> Path:
        target = Target(
            "cgpu-bypass-static",
            ("tools/cgpu_bypass.c", *_sim_driver().sources),
            libs=("-lpthread",),
            includes=("include", "simgpu"),
        )
        variant = Variant("static", ("-O2",), ("-static",), ("CGPU_BYPASS_LINK",))
        return _compile(target, tmp, variant)

    return _cached("static", build)


def _kernel_headers(tmp: Path) -> Path:
    kh = tmp / "kernel-headers"
    kh.mkdir()
    for name, target in KERNEL_HEADERS.items():
        assert Path(target).is_dir(), f"{target} missing: install linux-libc-dev"
        (kh / name).symlink_to(target)
    return kh


def musl_libcuda() -> Path:
    cc = _need("musl-gcc", "musl-tools")

    def build(tmp: Path) -> Path:
        variant = Variant("musl", ("-O2",), (), (), (str(_kernel_headers(tmp)),))
        return _compile(_sim_driver(), tmp, variant, cc=cc)

    return _cached("musl-libcuda", build)


def musl_bypass() -> Path:
    cc = _need("musl-gcc", "musl-tools")
    assert MUSL_LOADER.exists(), f"{MUSL_LOADER} missing: install musl (with musl-tools)"
    lib = musl_libcuda()

    def build(tmp: Path) -> Path:
        target = Target("cgpu-bypass-musl", ("tools/cgpu_bypass.c",), libs=(f"-L{lib.parent}", "-l:libcuda.so.1"))
        variant = Variant("musl", ("-O2",), (), ("CGPU_BYPASS_LINK",))
        return _compile(target, tmp, variant, cc=cc)

    return _cached("musl-bypass", build, str(lib))


def musl_host_env() -> list[str]:
    return [f"LD_LIBRARY_PATH={musl_libcuda().parent}"]


def _place(root: Path, host: Path, inside: str) -> None:
    """A new file: bundles share their template's files by hard link, so an
    existing one is unlinked, never written through."""
    dest = root / inside.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(missing_ok=True)
    shutil.copy2(host, dest)


def musl_rootfs(dest: Path) -> Path:
    if not (dest / "bin" / "busybox").exists():
        from tests.harness.oci import build_rootfs

        build_rootfs(dest)
    _place(dest, MUSL_LOADER.resolve(), str(MUSL_LOADER))
    _place(dest, musl_libcuda(), f"{MUSL_LIB_DIR}/libcuda.so.1")
    _place(dest, musl_bypass(), MUSL_TENANT)
    path = dest / "etc" / "ld-musl-x86_64.path"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.write_text(f"{MUSL_LIB_DIR}\n")
    return dest
