"""How every C part of cgpu is built: one table of targets, one compile
function. setup.py calls it during `pip install`; tests call it for the
sanitizer and real-cuda.h builds. Needs only a C compiler."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

CSRC = Path(__file__).resolve().parent
PYPROJECT = CSRC.parent / "pyproject.toml"

WARNINGS = ("-Wall", "-Wextra", "-Werror")
BASE_FLAGS = ("-std=c11", "-g", "-fPIC", "-fvisibility=hidden", "-fno-semantic-interposition", *WARNINGS)
SANITIZE_FLAGS = ("-O1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
SIM_STATE = ("simgpu/simstate.c", "simgpu/simconfig.c", "simgpu/simmig.c")
# The simulated driver's device and host memory, one family a file.
SIM_MEMORY = tuple(
    f"simgpu/{f}"
    for f in (
        "driver_alloc.c",
        "driver_pool.c",
        "driver_vmm.c",
        "driver_ipc.c",
        "driver_array.c",
        "driver_limits.c",
        "driver_hostmem.c",
        "driver_managed.c",
        "driver_copy.c",
        "driver_hostfn.c",
        "driver_pointer.c",
    )
)
FREESTANDING_MACHINES = ("x86_64", "aarch64")
FREESTANDING_CFLAGS = (
    "-DCGPU_FRONT_FREESTANDING",
    "-ffreestanding",
    "-fno-stack-protector",
    # else GCC may turn memset's own loop into a call to memset
    "-fno-tree-loop-distribute-patterns",
)
FREESTANDING_LDFLAGS = ("-static", "-nostdlib", "-no-pie")


@dataclass(frozen=True)
class Target:
    """One binary: a shared library (exports listed by an X-macro .def) or
    an executable, relative to the output directory."""

    output: str
    sources: tuple[str, ...]
    exports: tuple[str, str] | None = None  # (.def file under csrc/, macro)
    extra_exports: tuple[tuple[str, str], ...] = ()  # more (.def, macro) lists, e.g. generated stubs
    libs: tuple[str, ...] = ()
    includes: tuple[str, ...] = ("include",)
    cflags: tuple[str, ...] = ()  # paths under csrc/ given as csrc/<path>
    # Built without libc (its own _start and system calls) where it knows
    # how (FREESTANDING_MACHINES) and the variant allows (not sanitizers).
    freestanding: bool = False

    @property
    def shared(self) -> bool:
        return ".so" in Path(self.output).name


TARGETS: tuple[Target, ...] = (
    Target(
        "sim/libcuda.so.1",
        (
            "simgpu/driver_core.c",
            *SIM_MEMORY,
            "simgpu/driver_exec.c",
            "simgpu/driver_forwards.c",
            "simgpu/export_tables.c",
            "simgpu/library.c",
            "simgpu/capture.c",
            "simgpu/driver_stubs.c",
            "simgpu/mps_client.c",
            "simgpu/mps_wire.c",
            *SIM_STATE,
        ),
        exports=("include/cgpu/cuda_functions.def", "CU_FN"),
        extra_exports=(("simgpu/cuda_unmodelled.def", "CU_STUB"),),
        libs=("-lpthread",),
        includes=("include", "simgpu"),
    ),
    Target(
        "sim/libnvidia-ml.so.1",
        ("simgpu/nvml.c", "simgpu/nvml_mig.c", "simgpu/nvml_stubs.c", *SIM_STATE),
        exports=("include/cgpu/nvml_functions.def", "NVML_FN"),
        extra_exports=(("simgpu/nvml_unmodelled.def", "NVML_STUB"),),
        libs=("-lpthread",),
        includes=("include", "simgpu"),
    ),
    Target(
        "lib/libcgpu.so",
        (
            "intercept/init.c",
            "intercept/dispatch.c",
            "intercept/resolve.c",
            "intercept/memory.c",
            "intercept/nvml_view.c",
            "intercept/launch.c",
            "intercept/mps_env.c",
            "region/region.c",
            "region/region_file.c",
        ),
        exports=("intercept/hooks.def", "HOOK"),
        # Linked even where glibc >= 2.34 no longer needs them: older images
        # find dlopen and pthread_create there (intercept/glibc_baseline.h).
        libs=("-Wl,--no-as-needed", "-l:libdl.so.2", "-l:libpthread.so.0", "-Wl,--as-needed"),
        includes=("include", "intercept"),
        cflags=("-include", "csrc/intercept/glibc_baseline.h"),
    ),
    # The simulated GPUs' MPS, installed beside their driver as NVIDIA's
    # driver installs its own (the control daemon finds the server beside it).
    Target(
        "sim/nvidia-cuda-mps-control",
        ("simgpu/mps_control.c", "simgpu/mps_wire.c", *SIM_STATE),
        libs=("-lpthread",),
        includes=("include", "simgpu"),
    ),
    Target(
        "sim/nvidia-cuda-mps-server",
        ("simgpu/mps_server.c", "simgpu/mps_wire.c", *SIM_STATE),
        libs=("-lpthread",),
        includes=("include", "simgpu"),
    ),
    Target("bin/cgpu-sim-stat", ("simgpu/simstat.c", *SIM_STATE), includes=("include", "simgpu")),
    Target("bin/cgpu-burn", ("tools/cgpu_burn.c",), libs=("-ldl",)),
    # Hostile tenant that finds the driver's entry points without dlsym (tests/harness/bypass_build.py).
    Target("bin/cgpu-bypass", ("tools/cgpu_bypass.c",), libs=("-ldl",)),
    # The front every runtime command goes through (runtime_front.c), and
    # the shim proper it hands GPU starts to, found beside it.
    Target("bin/cgpu-runtime", ("hook/runtime_front.c",), freestanding=True),
    Target("bin/cgpu-runtime-gpu", ("hook/cgpu_runtime.c", "hook/relay.c")),
    Target("bin/cgpu-hook", ("hook/cgpu_hook.c",), freestanding=True),
)


@dataclass(frozen=True)
class Variant:
    """How to compile: the release build, or a checking build."""

    name: str = "release"
    cflags: tuple[str, ...] = ("-O2",)
    ldflags: tuple[str, ...] = ()
    defines: tuple[str, ...] = ()
    extra_includes: tuple[str, ...] = field(default=())
    # Link libdl and libpthread as -ldl/-lpthread, not by file name: zig's
    # stubs of an older glibc (packaging/zig.py) take only that form, while
    # glibc >= 2.34's own -ldl finds an empty archive and links nothing.
    libs_by_name: bool = False


RELEASE = Variant()
SANITIZE = Variant("sanitize", SANITIZE_FLAGS, ("-fsanitize=address,undefined",))


def real_cuda_h(include: Path) -> Variant:
    """Built against NVIDIA's cuda.h in `include` instead of our ABI subset.
    -O0: the build only proves our prototypes agree with NVIDIA's, which the
    optimiser adds nothing to, and it is a third of the time."""
    return Variant("real-cuda-h", ("-O0",), (), ("CGPU_USE_REAL_CUDA_H",), (str(include),))


def real_nvml_h(include: Path) -> Variant:
    """Built against NVIDIA's nvml.h in `include` (as real_cuda_h)."""
    return Variant("real-nvml-h", ("-O0",), (), ("CGPU_USE_REAL_NVML_H",), (str(include),))


class NativeBuildError(RuntimeError):
    pass


def package_version() -> str:
    """The version the relays print: the package's own, read where the
    package gets it (cgpud.__version__ is the installed metadata of it)."""
    return tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def version_define() -> str:
    return f'-DCGPU_VERSION="{package_version()}"'


def exported_symbols(def_file: str, macro: str) -> list[str]:
    """Symbols a library exports: the first argument of each macro line."""
    text = (CSRC / def_file).read_text()
    return sorted(set(re.findall(rf"^{macro}\((\w+)", text, re.MULTILINE)))


def target_exports(target: Target) -> list[str]:
    """Every symbol the target's library exports, from all its lists."""
    lists = ((target.exports,) if target.exports else ()) + target.extra_exports
    return sorted({s for def_file, macro in lists for s in exported_symbols(def_file, macro)})


def _version_script(target: Target, workdir: Path) -> list[str]:
    if not target.exports:
        return []
    symbols = target_exports(target)
    script = workdir / (Path(target.output).name + ".map")
    script.write_text("{\n  global:\n" + "".join(f"    {s};\n" for s in symbols) + "  local: *;\n};\n")
    return [f"-Wl,--version-script={script}"]


def compile_target(target: Target, out_dir: Path, variant: Variant = RELEASE, cc: str | None = None) -> Path:
    cc = cc or os.environ.get("CC") or "cc"
    out = out_dir / target.output
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cgpu-build-") as tmp:
        freestanding = (
            target.freestanding and variant.name != SANITIZE.name and platform.machine() in FREESTANDING_MACHINES
        )
        cmd = [cc, *BASE_FLAGS, *variant.cflags, version_define(), *(FREESTANDING_CFLAGS if freestanding else ())]
        cmd += [f"-D{d}" for d in variant.defines]
        cmd += [str(CSRC / f[len("csrc/") :]) if f.startswith("csrc/") else f for f in target.cflags]
        cmd += [f"-I{CSRC / inc}" for inc in target.includes]
        cmd += [f"-I{inc}" for inc in variant.extra_includes]
        if target.shared:
            cmd += ["-shared", f"-Wl,-soname,{Path(target.output).name}", *_version_script(target, Path(tmp))]
        cmd += [str(CSRC / src) for src in target.sources]
        libs = (
            [re.sub(r"^-l:lib(\w+)\.so\.\d+$", r"-l\1", lib) for lib in target.libs]
            if variant.libs_by_name
            else target.libs
        )
        cmd += ["-o", str(out), *variant.ldflags, *libs, *(FREESTANDING_LDFLAGS if freestanding else ())]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NativeBuildError(f"building {target.output} failed:\n$ {' '.join(cmd)}\n{proc.stderr}")
    return out


def build_all(out_dir: Path, variant: Variant = RELEASE, targets: tuple[Target, ...] = TARGETS) -> list[Path]:
    if shutil.which(os.environ.get("CC") or "cc") is None:
        raise NativeBuildError("no C compiler found: install gcc (apt-get install gcc) or set CC")
    return [compile_target(t, out_dir, variant) for t in targets]


def main(argv: list[str]) -> int:
    variants = {v.name: v for v in (RELEASE, SANITIZE)}
    name = argv[1] if len(argv) == 2 else "release"
    if name.startswith("real-cuda-h=") and len(name) > len("real-cuda-h="):
        variants[name] = real_cuda_h(Path(name.split("=", 1)[1]))
    if len(argv) not in (1, 2) or name not in variants:
        print("usage: build_native.py OUT_DIR [release|sanitize|real-cuda-h=CUDA_INCLUDE_DIR]", file=sys.stderr)
        return 2
    try:
        for path in build_all(Path(argv[0]), variants[name]):
            print(path)
    except NativeBuildError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
