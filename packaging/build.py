"""Build the deb and rpm of cgpu: a self-contained tree under
/opt/cgpu/<version>/ (this machine's CPython, the runtime dependencies from
the venv, the project with every C part), thin entry points in /usr/bin, the
systemd unit and a commented default /etc/cgpu/config.toml.

    python packaging/build.py [--version V] [--out dist] [--formats deb,rpm]

Run it with the venv's interpreter after the C parts are built (`./dev
package` does both). The expensive part, the version-independent tree, is
staged once under --work and reused by every version built in the same call
(and by later calls with --reuse), so tests can build a "previous" and a
"newer" package cheaply.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from elf_needs import ElfError, elf_files, newest_glibc

REPO = Path(__file__).resolve().parent.parent
PACKAGING = REPO / "packaging"
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
PACKAGE = "cgpu"

# Standard-library parts a daemon never imports: tests, GUIs, installers.
# (config-*, the static libpython for embedding, is skipped too.)
STDLIB_PRUNE = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "site-packages",
    "venv",
    "__pycache__",
    "turtle.py",
}
DYNLOAD_PRUNE = re.compile(r"^(_tkinter|_test|_xxtest|xxlimited|_ctypes_test|xxsubtype)")


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Layout:
    """Where one version's files go on the target system."""

    version: str

    @property
    def prefix(self) -> Path:
        return Path("/opt/cgpu") / self.version

    @property
    def python(self) -> Path:
        return self.prefix / "python" / "bin" / PYVER

    @property
    def site_packages(self) -> Path:
        return self.prefix / "python" / "lib" / PYVER / "site-packages"

    @property
    def native(self) -> Path:
        return self.site_packages / "cgpud" / "_native"


def project_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def console_scripts() -> dict[str, str]:
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def run(*args: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise BuildError(f"{' '.join(map(str, args))} failed ({result.returncode}): {result.stderr[-3000:]}")
    return result


# ------------------------------------------------------------ the base tree


def _copy_tree(src: Path, dst: Path, skip: Iterable[str] = ()) -> None:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", *skip), dirs_exist_ok=True)


def _runpath(binary: Path) -> str | None:
    out = run("readelf", "-d", binary).stdout
    m = re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", out)
    return m.group(1) if m else None


def _relocate(binary: Path, old_prefix: str) -> None:
    """pyenv's CPython finds its stdlib relative to the executable but its
    libpython through an absolute RUNPATH; rewrite that string in place to
    $ORIGIN/../lib (padded with NULs: .dynstr keeps its size)."""
    runpath = _runpath(binary)
    if runpath is None or not runpath.startswith(old_prefix):
        return
    new = runpath.replace(old_prefix, "$ORIGIN/..", 1).encode()
    old = runpath.encode()
    if len(new) > len(old):
        raise BuildError(f"{binary}: RUNPATH {runpath} is too short to rewrite to {new.decode()}")
    data = binary.read_bytes()
    if data.count(old + b"\0") != 1:
        raise BuildError(f"{binary}: RUNPATH {runpath} is not a single string in the file")
    binary.chmod(0o755)
    binary.write_bytes(data.replace(old + b"\0", new + b"\0" * (len(old) - len(new) + 1)))


def stage_python(dest: Path) -> None:
    """This interpreter's base installation, pruned, with an empty
    site-packages of its own."""
    base = Path(sys.base_prefix)
    exe = base / "bin" / PYVER
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(exe, dest / "bin" / PYVER)
    (dest / "bin" / "python3").symlink_to(PYVER)
    libdir = dest / "lib"
    libdir.mkdir()
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        real = base / "lib" / ldlib
        for so in (base / "lib").glob(f"lib{PYVER}.so*"):
            if so.is_symlink():
                (libdir / so.name).symlink_to(os.readlink(so))
            else:
                shutil.copy2(so, libdir / so.name)
        if not real.exists():
            raise BuildError(f"{real} is missing: cannot bundle libpython")
    stdlib_src = base / "lib" / PYVER
    stdlib = libdir / PYVER
    stdlib.mkdir()
    for entry in stdlib_src.iterdir():
        if entry.name in STDLIB_PRUNE or entry.name.startswith("config-"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            _copy_tree(entry, stdlib / entry.name, skip=("test", "tests", "idle_test"))
        else:
            shutil.copy2(entry, stdlib / entry.name, follow_symlinks=False)
    for so in (stdlib / "lib-dynload").iterdir():
        if DYNLOAD_PRUNE.match(so.name):
            so.unlink()
    (stdlib / "site-packages").mkdir()
    _relocate(dest / "bin" / PYVER, str(base))


def _requirements(dist: metadata.Distribution, extras: Iterable[str] = ()) -> list[tuple[str, frozenset[str]]]:
    """What `dist` with `extras` needs on this platform: (name, its extras)."""
    from packaging.requirements import Requirement

    needed = []
    for raw in dist.requires or []:
        req = Requirement(raw)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        needed.append((req.name, frozenset(req.extras)))
    return needed


def runtime_distributions() -> list[metadata.Distribution]:
    """cgpud's dependencies, transitively, as installed in this venv
    (without extras: no test tools)."""
    seen: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    todo = _requirements(metadata.distribution("cgpud"))
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if (key, extras) in done:
            continue
        done.add((key, extras))
        try:
            dist = seen.get(key) or metadata.distribution(name)
        except metadata.PackageNotFoundError as e:
            raise BuildError(f"dependency {name} is not installed in {sys.prefix}: run ./dev first") from e
        seen[key] = dist
        todo.extend(_requirements(dist, extras))
    return sorted(seen.values(), key=lambda d: d.metadata["Name"].lower())


def stage_dependencies(site: Path) -> None:
    for dist in runtime_distributions():
        for file in dist.files or []:
            src = Path(str(file.locate())).resolve()
            rel = Path(str(file))
            if rel.parts[0] == ".." or "__pycache__" in rel.parts or not src.is_file():
                continue  # scripts in bin/ and bytecode: the package compiles its own
            dst = site / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def stage_project(site: Path) -> None:
    """The source tree's cgpud with the C parts built in place (the
    extensions, the relays, libcgpu, the simulated driver and its tools)."""
    src = REPO / "cgpud"
    for needed in (
        "_native/lib/libcgpu.so",
        "_native/bin/cgpu-runtime",
        "_native/bin/cgpu-runtime-gpu",
        "_native/sim/libcuda.so.1",
    ):
        if not (src / needed).exists():
            raise BuildError(f"{src / needed} is missing: build the C parts first (./dev package does)")
    if not list(src.glob("_region*.so")) or not list(src.glob("_scheduler*.so")):
        raise BuildError("the cffi extensions are not built: run `python setup.py build_ext --inplace`")
    _copy_tree(src, site / "cgpud", skip=("*.c", "*.o", "*.pyc"))


def stage_base(base: Path) -> None:
    if base.exists():
        shutil.rmtree(base)
    python = base / "python"
    stage_python(python)
    site = python / "lib" / PYVER / "site-packages"
    stage_dependencies(site)
    stage_project(site)
    # Bytecode now, by the bundled interpreter: a read-only /opt never gets
    # a __pycache__ that dpkg does not know about, and the daemon starts
    # fast. Unchecked hashes: file times in the package do not matter.
    bundled = python / "bin" / PYVER
    run(
        bundled,
        "-I",
        "-m",
        "compileall",
        "-q",
        "-j",
        "0",
        "--invalidation-mode",
        "unchecked-hash",
        python / "lib" / PYVER,
    )


# ---------------------------------------------------- one version's root


def default_config_text() -> str:
    from cgpud.config import DaemonConfig

    lines = [
        "# cgpud's settings. Every line below is commented out and shows the",
        "# built-in default; uncomment and change what this host needs, then",
        "# `systemctl restart cgpud`. A flag on cgpud's command line wins over",
        "# this file. Your edits survive package upgrades (a conffile).",
        "",
    ]
    for f in dataclasses.fields(DaemonConfig):
        value = f.default
        if isinstance(value, enum.Enum):
            value = value.value
        if isinstance(value, Path):
            value = str(value)
        if isinstance(value, bool):
            shown = "true" if value else "false"
        elif isinstance(value, str):
            shown = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            shown = repr(value)
        lines.append(f"# {f.metadata['help']}")
        lines.append(f"# {f.name} = {shown}")
        lines.append("")
    return "\n".join(lines)


def _wrapper(layout: Layout, target: str) -> str:
    module, func = target.split(":")
    # -I: no PYTHON* variables, no user site, no script directory on the
    # path; -B: never write bytecode into /opt (it is all precompiled).
    return f"#!{layout.python} -IB\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"


def stage_root(base: Path, root: Path, version: str) -> Layout:
    """The target file system of one version, hard-linked to the base."""
    layout = Layout(version)
    if root.exists():
        shutil.rmtree(root)
    prefix = root / layout.prefix.relative_to("/")
    prefix.parent.mkdir(parents=True)
    run("cp", "-al", base, prefix)
    site = root / layout.site_packages.relative_to("/")
    info = site / f"cgpud-{version}.dist-info"
    info.mkdir()
    # cgpud.__version__ is read from this metadata: the package's version.
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cgpud\nVersion: {version}\n")
    (info / "INSTALLER").write_text("cgpu package\n")
    scripts = console_scripts()
    (info / "entry_points.txt").write_text("[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items()))
    (info / "RECORD").write_text("")
    bindir = prefix / "bin"
    bindir.mkdir()
    usr_bin = root / "usr" / "bin"
    usr_bin.mkdir(parents=True)
    for name, target in scripts.items():
        (bindir / name).write_text(_wrapper(layout, target))
        (bindir / name).chmod(0o755)
        (usr_bin / name).symlink_to(layout.prefix / "bin" / name)
    # A stable path for containerd's and Docker's configuration: it still
    # names the runtime after an upgrade removed the old version's tree.
    (usr_bin / "cgpu-runtime").symlink_to(layout.native / "bin" / "cgpu-runtime")
    etc = root / "etc" / "cgpu"
    etc.mkdir(parents=True)
    (etc / "config.toml").write_text(default_config_text())
    return layout


# ----------------------------------------------------------------- the deb


def deb_depends(root: Path, glibc: str) -> list[str]:
    """Debian packages of the shared libraries the ELF files outside the
    tree load (libssl, libsqlite3, libffi ...): what pyenv's CPython was
    built against on this machine; libc6 at least `glibc` (glibc_floor)."""
    libs: set[str] = set()
    for path in elf_files(root):
        out = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
        for m in re.finditer(r"=> (/\S+)", out):
            lib = Path(m.group(1))
            if (
                not str(lib.resolve()).startswith(str(root))
                and "libpython" not in lib.name
                and not lib.name.startswith(("libcuda", "libnvidia-ml"))
            ):
                libs.add(str(lib))
    packages: set[str] = set()
    for lib in sorted(libs):
        for candidate in (lib, str(Path(lib).resolve())):
            found = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
            if found.returncode == 0:
                packages.add(found.stdout.split(":")[0])
                break
            # usrmerge: dpkg knows /lib/... while ldd says /usr/lib/...
            alt = candidate.removeprefix("/usr") if candidate.startswith("/usr/lib") else None
            if alt:
                found = subprocess.run(["dpkg", "-S", alt], capture_output=True, text=True)
                if found.returncode == 0:
                    packages.add(found.stdout.split(":")[0])
                    break
        else:
            raise BuildError(f"no Debian package owns {lib}: cannot state the deb's dependencies")
    return sorted(f"{p} (>= {glibc})" if p == "libc6" else p for p in packages)


def glibc_floor(root: Path) -> str:
    """The newest GLIBC_ symbol version any ELF file in the tree needs
    (elf_needs.py): the oldest glibc the package runs on."""
    try:
        newest, _ = newest_glibc(root)
    except ElfError as e:
        raise BuildError(str(e)) from e
    return ".".join(map(str, newest))


def _installed_size_kib(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            total += (path.stat().st_size + 1023) // 1024
    return total


def build_deb(root: Path, layout: Layout, out: Path, depends: Sequence[str]) -> Path:
    debian = root / "DEBIAN"
    debian.mkdir()
    unit_dir = root / "lib" / "systemd" / "system"
    unit_dir.mkdir(parents=True)
    shutil.copy2(REPO / "systemd" / "cgpud.service", unit_dir / "cgpud.service")
    control = (
        (PACKAGING / "deb" / "control")
        .read_text()
        .format(version=layout.version, depends=", ".join(depends), installed_size=_installed_size_kib(root))
    )
    (debian / "control").write_text(control)
    shutil.copy2(PACKAGING / "deb" / "conffiles", debian / "conffiles")
    for script in ("prerm", "postinst", "postrm"):
        shutil.copy2(PACKAGING / "deb" / script, debian / script)
        (debian / script).chmod(0o755)
    out.mkdir(parents=True, exist_ok=True)
    deb = out / f"{PACKAGE}_{layout.version}_amd64.deb"
    # xz, which dpkg reads from Debian 9 and Ubuntu 16.04 on (zstd members only
    # from Debian 12 and Ubuntu 21.10); level 1: the build runs in CI on every push.
    run("dpkg-deb", "--root-owner-group", "-Zxz", "-z1", "--build", root, deb)
    shutil.rmtree(debian)
    shutil.rmtree(root / "lib")
    return deb


# ----------------------------------------------------------------- the rpm


def build_rpm(root: Path, layout: Layout, out: Path, work: Path, glibc: str) -> Path:
    top = work / f"rpmbuild-{layout.version}"
    if top.exists():
        shutil.rmtree(top)
    for d in ("BUILD", "RPMS", "SOURCES", "SPECS", "SRPMS", "BUILDROOT"):
        (top / d).mkdir(parents=True)
    # rpm's Version may not hold '-'; deb versions we build never do either.
    if "-" in layout.version:
        raise BuildError(f"version {layout.version!r}: rpm versions cannot contain '-'")
    run(
        "rpmbuild",
        "-bb",
        "--quiet",
        "--nodeps",
        "--define",
        f"_topdir {top}",
        "--define",
        f"cgpu_version {layout.version}",
        "--define",
        f"cgpu_root {root}",
        "--define",
        f"glibc_min {glibc}",
        "--define",
        f"cgpu_unit {REPO / 'systemd' / 'cgpud.service'}",
        PACKAGING / "rpm" / "cgpu.spec",
    )
    built = list((top / "RPMS").rglob("*.rpm"))
    if len(built) != 1:
        raise BuildError(f"rpmbuild made {built}, expected one rpm")
    out.mkdir(parents=True, exist_ok=True)
    rpm = out / f"{PACKAGE}-{layout.version}-1.x86_64.rpm"
    shutil.move(built[0], rpm)
    shutil.rmtree(top)
    return rpm


# ------------------------------------------------------------------- entry


def build(
    versions: Sequence[str], out: Path, work: Path, formats: Sequence[str] = ("deb", "rpm"), reuse: bool = False
) -> list[Path]:
    base = work / "base"
    if not (reuse and (base / "python" / "bin" / PYVER).exists()):
        stage_base(base)
    # Read once: every version's root is the base tree, hard-linked.
    glibc = glibc_floor(base)
    depends = deb_depends(base, glibc) if "deb" in formats else []
    made = []
    for version in versions:
        root = work / f"root-{version}"
        layout = stage_root(base, root, version)
        if "rpm" in formats:
            made.append(build_rpm(root, layout, out, work, glibc))
        if "deb" in formats:
            made.append(build_deb(root, layout, out, depends))
        shutil.rmtree(root)
    return made


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build cgpu's deb and rpm.")
    p.add_argument(
        "--version",
        action="append",
        dest="versions",
        help="package version (default: pyproject's); repeat to build several from one staged tree",
    )
    p.add_argument("--out", type=Path, default=REPO / "dist")
    p.add_argument("--work", type=Path, default=REPO / "build" / "package")
    p.add_argument("--formats", default="deb,rpm", help="comma-separated: deb, rpm")
    p.add_argument("--reuse", action="store_true", help="reuse the staged base tree of an earlier run")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if set(formats) - {"deb", "rpm"}:
        p.error("--formats takes deb and rpm")
    try:
        for path in build(args.versions or [project_version()], args.out, args.work, formats, args.reuse):
            print(path)
    except BuildError as e:
        print(f"packaging: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
