"""Build the deb and rpm of cgpu: a self-contained tree under
/opt/cgpu/<version>/ (a CPython built for glibc 2.17 by interpreter.py, the
venv's runtime dependencies as manylinux2014 wheels, the project with every
C part built by zig for glibc 2.17), thin entry points in /usr/bin, the
systemd unit and a commented default /etc/cgpu/config.toml. Every ELF file
needs at most GLIBC_2.17: the packages run on CentOS 7 and everything newer.

    python packaging/build.py [--version V] [--out dist] [--formats deb,rpm]

Run it with the venv's interpreter (`./dev package` does). The first run
builds zig's CPython (minutes; cached outside the clone). The expensive
part, the version-independent tree, is staged once under --work and reused
by every version built in the same call (and by later calls with --reuse),
so tests can build a "previous" and a "newer" package cheaply."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from elf_needs import ElfError, elf_files, newest_glibc
from interpreter import Interpreter
from interpreter import install as install_interpreter
from zig import Zig, pip_install
from zig import install as install_zig

REPO = Path(__file__).resolve().parent.parent
PACKAGING = REPO / "packaging"
sys.path.insert(0, str(REPO / "csrc"))
import build_native  # noqa: E402

PORTABLE = build_native.Variant("portable", libs_by_name=True)
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


def stage_python(interp: Interpreter, dest: Path) -> None:
    """The interpreter built for glibc 2.17 (interpreter.py), pruned, with
    an empty site-packages of its own."""
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(interp.python, dest / "bin" / PYVER)
    (dest / "bin" / "python3").symlink_to(PYVER)
    stdlib = dest / "lib" / PYVER
    stdlib.mkdir(parents=True)
    for entry in interp.stdlib.iterdir():
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
    """The venv's runtime dependencies at the venv's versions, as the
    manylinux2014 (glibc 2.17) wheels PyPI serves for them: the venv's own
    may be built for this machine's newer glibc."""
    pins = [f"{d.metadata['Name']}=={d.version}" for d in runtime_distributions()]
    platforms = [f"--platform={p}_x86_64" for p in ("manylinux_2_17", "manylinux2014", "manylinux2010", "manylinux1")]
    pip = pip_install(
        site,
        "--no-compile",
        "--only-binary=:all:",
        "--implementation=cp",
        f"--python-version={sys.version_info.major}.{sys.version_info.minor}",
        *platforms,
        *pins,
    )
    if pip.returncode != 0:
        raise BuildError(f"pip could not install the manylinux2014 wheels of {', '.join(pins)}:\n{pip.stderr[-3000:]}")
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts of the dependencies: unused


def stage_project(site: Path, zig: Zig, interp: Interpreter) -> None:
    """The source tree's cgpud, with every C part built again by zig for
    glibc 2.17: the relays, libcgpu, the simulated driver and its tools
    (csrc/build_native.py), and the cffi extensions (setup.py build_ext)."""
    src = REPO / "cgpud"
    _copy_tree(src, site / "cgpud", skip=("*.c", "*.o", "*.pyc", "*.so", "*.so.*", "_native"))
    native = site / "cgpud" / "_native"
    for target in build_native.TARGETS:
        # The freestanding front calls no libc at all: the host's gcc, which
        # knows its flags, builds it; it needs no glibc version.
        if target.freestanding:
            build_native.compile_target(target, native, build_native.RELEASE)
        else:
            build_native.compile_target(target, native, PORTABLE, cc=str(zig.cc))
    with tempfile.TemporaryDirectory(prefix="cgpu-ext-") as tmp:
        env = dict(os.environ)
        # distutils takes the compiler from CC/LDSHARED; the interpreter's
        # own headers come first (CFLAGS precede the venv's -I).
        env.update({"CC": str(zig.cc), "LDSHARED": f"{zig.cc} -shared", "CFLAGS": f"-I{interp.include}"})
        run(
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--force",
            "--build-lib",
            Path(tmp) / "lib",
            "--build-temp",
            Path(tmp) / "temp",
            cwd=REPO,
            env=env,
        )
        built = sorted((Path(tmp) / "lib" / "cgpud").glob("_*.so"))
        if {p.name.split(".")[0] for p in built} != {"_region", "_scheduler"}:
            raise BuildError(f"setup.py build_ext made {[p.name for p in built]}, expected _region and _scheduler")
        for ext in built:
            shutil.copy2(ext, site / "cgpud" / ext.name)


def stage_base(base: Path) -> None:
    if base.exists():
        shutil.rmtree(base)
    python = base / "python"
    interp = install_interpreter()
    stage_python(interp, python)
    site = python / "lib" / PYVER / "site-packages"
    stage_dependencies(site)
    stage_project(site, install_zig(), interp)
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


# The packages that own each shared library the tree may load from the
# system, as RHEL and its rebuilds (CentOS 7, Rocky, Alibaba Cloud Linux)
# name them: the same names from CentOS 7 to RHEL 9.
RPM_OWNERS = {
    "libc.so.6": "glibc",
    "libm.so.6": "glibc",
    "libpthread.so.0": "glibc",
    "libdl.so.2": "glibc",
    "librt.so.1": "glibc",
    "libutil.so.1": "glibc",
    "ld-linux-x86-64.so.2": "glibc",
    "libstdc++.so.6": "libstdc++",
    "libgcc_s.so.1": "libgcc",
}


def system_libraries(root: Path) -> set[Path]:
    """The shared libraries the ELF files under root load from outside it
    (ldd on this machine; the simulated and real drivers are not among
    them: they are loaded by path, or provided by the GPU driver)."""
    libs: set[Path] = set()
    for path in elf_files(root):
        out = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
        for m in re.finditer(r"=> (/\S+)", out):
            lib = Path(m.group(1))
            if not str(lib.resolve()).startswith(str(root)) and not lib.name.startswith(("libcuda", "libnvidia-ml")):
                libs.add(lib)
    return libs


def deb_depends(libs: Iterable[Path], glibc: str) -> list[str]:
    """The Debian packages that own `libs`; libc6 at least `glibc` (glibc_floor)."""
    packages: set[str] = set()
    for lib in sorted(libs):
        for candidate in (str(lib), str(lib.resolve())):
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


def rpm_requires(libs: Iterable[Path], glibc: str) -> list[str]:
    """The RHEL packages that own `libs` (RPM_OWNERS); glibc at least `glibc`."""
    unknown = sorted(lib.name for lib in libs if lib.name not in RPM_OWNERS)
    if unknown:
        raise BuildError(f"no RHEL package is known for {', '.join(unknown)}: add it to RPM_OWNERS")
    packages = {RPM_OWNERS[lib.name] for lib in libs} | {"glibc"}
    return sorted(f"{p} >= {glibc}" if p == "glibc" else p for p in packages)


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


def build_rpm(root: Path, layout: Layout, out: Path, work: Path, requires: Sequence[str]) -> Path:
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
        f"cgpu_requires {', '.join(requires)}",
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
    libs = system_libraries(base)
    depends = deb_depends(libs, glibc) if "deb" in formats else []
    requires = rpm_requires(libs, glibc)
    made = []
    for version in versions:
        root = work / f"root-{version}"
        layout = stage_root(base, root, version)
        if "rpm" in formats:
            made.append(build_rpm(root, layout, out, work, requires))
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
