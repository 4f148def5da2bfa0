"""The CUDA toolchains the tests build and run real CUDA programs with: NVIDIA's
own wheels from PyPI, one pinned set per runtime line users run, each installed
once into a prefix of its own outside the clone (cached by line and pins).

No test reads a toolkit installed on the machine. `./dev test` installs every line before pytest
starts (`python -m tests.harness.cudakit install`); a test asking for a line that is
not there yet installs it then, so a plain `pytest` works too. A line that
cannot be installed is a failure, never a skip.

PyPI has no nvcc for 12.x (nvidia-cuda-nvcc-cu12 carries ptxas, libnvvm and
the crt headers only): programs for 12.9 are built by the host compiler and
load kernels nvcc 13 made (tests/cuda/runtime_steps.c)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "CGPU_CUDA_CACHE"


@dataclass(frozen=True)
class Line:
    """One CUDA runtime line: its pinned wheels and where they put things."""

    name: str
    requirements: tuple[str, ...]
    cudart_soname: str
    # under the prefix
    include_dirs: tuple[str, ...]
    lib_dir: str
    nvcc: str | None

    @property
    def version(self) -> int:
        """As cudaRuntimeGetVersion reports it: 13.5 is 13050."""
        major, minor = self.name.split(".")
        return int(major) * 1000 + int(minor) * 10

    def key(self) -> str:
        pins = hashlib.sha256("\n".join(self.requirements).encode()).hexdigest()[:12]
        return f"{self.name}-{pins}"


_CU13 = ("nvidia/cu13/include",)
LINES: dict[str, Line] = {
    line.name: line
    for line in (
        Line(
            "12.9",
            (
                "nvidia-cuda-runtime-cu12==12.9.79",
                "nvidia-cuda-nvcc-cu12==12.9.86",
                "nvidia-nvml-dev-cu12==12.9.79",
                "nvidia-cuda-profiler-api-cu12==12.9.79",
            ),
            "libcudart.so.12",
            (
                "nvidia/cuda_runtime/include",
                "nvidia/cuda_nvcc/include",
                "nvidia/nvml_dev/include",
                "nvidia/cuda_profiler_api/include",
            ),
            "nvidia/cuda_runtime/lib",
            None,
        ),
        Line(
            "13.0",
            (
                "nvidia-cuda-nvcc==13.0.88",
                "nvidia-cuda-runtime==13.0.96",
                "nvidia-cuda-crt==13.0.88",
                "nvidia-nvvm==13.0.88",
                "nvidia-nvml-dev==13.0.87",
                "nvidia-cuda-profiler-api==13.0.85",
            ),
            "libcudart.so.13",
            _CU13,
            "nvidia/cu13/lib",
            "nvidia/cu13/bin/nvcc",
        ),
        Line(
            "13.5",
            (
                "nvidia-cuda-nvcc==13.5.37",
                "nvidia-cuda-runtime==13.5.37",
                "nvidia-cuda-crt==13.5.37",
                "nvidia-nvvm==13.5.37",
                "nvidia-nvml-dev==13.5.37",
                "nvidia-cuda-profiler-api==13.5.25",
            ),
            "libcudart.so.13",
            _CU13,
            "nvidia/cu13/lib",
            "nvidia/cu13/bin/nvcc",
        ),
    )
}
# The line of the driver version the simulated GPU reports (13.0): its cuda.h
# is the ABI the simulated driver is checked against (tests/abi), and its nvcc
# builds the kernels every line loads.
DEFAULT = "13.0"
# NVML is the driver's and its header only grows: the simulated
# libnvidia-ml.so.1 is checked against the newest nvml.h.
NVML = "13.5"


class ToolkitError(RuntimeError):
    pass


@dataclass(frozen=True)
class Toolkit:
    """An installed line."""

    line: Line
    root: Path

    @property
    def include(self) -> Path:
        """Where cuda.h, cuda_runtime_api.h and nvml.h are (the first include dir)."""
        return self.root / self.line.include_dirs[0]

    @property
    def includes(self) -> list[Path]:
        return [self.root / d for d in self.line.include_dirs]

    @property
    def lib(self) -> Path:
        return self.root / self.line.lib_dir

    @property
    def cudart(self) -> Path:
        return self.lib / self.line.cudart_soname

    @property
    def nvcc(self) -> Path:
        if self.line.nvcc is None:
            raise ToolkitError(
                f"CUDA {self.line.name} has no nvcc on PyPI; build its programs with the host "
                f"compiler and load kernels made by CUDA {DEFAULT}'s nvcc"
            )
        return self.root / self.line.nvcc

    def header(self, name: str) -> Path:
        for inc in self.includes:
            if (inc / name).is_file():
                return inc / name
        raise ToolkitError(f"{name} is not in CUDA {self.line.name}'s headers under {self.root}")

    def cc_flags(self, cudart: str = "shared") -> list[str]:
        """Compiler and linker flags for a host program on this runtime,
        linked to the shared libcudart (found through an rpath) or the static one."""
        flags = [f"-I{inc}" for inc in self.includes] + [f"-L{self.lib}"]
        if cudart == "shared":
            return flags + [f"-l:{self.line.cudart_soname}", f"-Wl,-rpath,{self.lib}"]
        if cudart == "static":
            return flags + ["-l:libcudart_static.a", "-ldl", "-lpthread", "-lrt"]
        raise ValueError(f"cudart must be 'shared' or 'static', not {cudart!r}")

    def nvcc_link_flags(self, cudart: str) -> list[str]:
        """nvcc's own -cudart shared/static look for unversioned names and a
        lib64 the wheels do not have: link the runtime by its file name instead."""
        if cudart == "shared":
            return [
                "-cudart",
                "none",
                f"-L{self.lib}",
                f"-l:{self.line.cudart_soname}",
                "-Xlinker",
                f"-rpath,{self.lib}",
            ]
        if cudart == "static":
            return ["-cudart", "none", f"-L{self.lib}", "-l:libcudart_static.a", "-ldl", "-lpthread", "-lrt"]
        raise ValueError(f"cudart must be 'shared' or 'static', not {cudart!r}")


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cgpu" / "cuda"


def _complete(root: Path) -> bool:
    return (root / ".complete").is_file()


def toolkit(name: str = DEFAULT) -> Toolkit:
    """The installed line, installing it first if it is not in the cache."""
    try:
        line = LINES[name]
    except KeyError:
        raise ToolkitError(f"unknown CUDA line {name!r}; known: {', '.join(LINES)}") from None
    cache = cache_root()
    root = cache / line.key()
    if not _complete(root):
        _install(line, cache, root)
    return Toolkit(line, root)


def _install(line: Line, cache: Path, root: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be installing the same line
        if _complete(root):
            return
        staging = Path(tempfile.mkdtemp(prefix=f".{line.name}-", dir=cache))
        try:
            # one pip call: a second --target into the same directory would not merge
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    "--no-deps",
                    "--target",
                    str(staging),
                    *line.requirements,
                ],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if proc.returncode != 0:
                raise ToolkitError(
                    f"installing CUDA {line.name} ({' '.join(line.requirements)}) failed:\n{proc.stderr[-3000:]}"
                )
            (staging / ".complete").write_text("\n".join(line.requirements) + "\n")
            shutil.rmtree(root, ignore_errors=True)
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv[:1] != ["install"] or any(a not in LINES for a in argv[1:]):
        print(f"usage: python -m tests.harness.cudakit install [{' '.join(LINES)}]", file=sys.stderr)
        return 2
    for name in argv[1:] or list(LINES):
        try:
            kit = toolkit(name)
        except ToolkitError as e:
            print(f"cudakit: {e}", file=sys.stderr)
            return 1
        print(f"CUDA {name}: {kit.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
