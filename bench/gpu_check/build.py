"""The programs a run needs, built into its temporary directory: the CUDA
toolchain from PyPI (tests/harness/cudakit.py) installed into a cache
directory, tests/cuda/spin.cu by its nvcc, bench/intercept_calls.c by the
host compiler; cgpu-burn, cgpu-bypass and libcgpu.so come with the package."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.gpu_check.model import CheckError
from bench.gpu_check.rig import Tools, run
from cgpud.native import native_path
from tests.harness import cudakit

ROOT = Path(__file__).resolve().parents[2]
# The kernels: PTX the driver compiles for whatever GPU it has (an H200 is
# sm_90), the same image the simulated driver reads.
GENCODE = "arch=compute_75,code=compute_75"


def toolkit(cache: Path) -> cudakit.Toolkit:
    """The default CUDA line, installed into `cache` unless it is there."""
    line = cudakit.LINES[cudakit.DEFAULT]
    root = cache / line.key()
    if not (root / ".complete").is_file():
        run(
            [sys.executable, "-m", "tests.harness.cudakit", "install", line.name],
            # the wheels stay in `cache` only: no pip download cache elsewhere
            dict(os.environ, PIP_NO_CACHE_DIR="1", **{cudakit.CACHE_ENV: str(cache)}),
            900,
            f"installing the CUDA {line.name} toolchain from PyPI into {cache}",
        )
    return cudakit.Toolkit(line, root)


def build(work: Path, cache: Path) -> Tools:
    out = work / "bin"
    out.mkdir(parents=True, exist_ok=True)
    kit = toolkit(cache)
    env = dict(os.environ)
    spin = out / "spin"
    run(
        [
            str(kit.nvcc),
            "-gencode",
            GENCODE,
            *kit.nvcc_link_flags("shared"),
            "-o",
            str(spin),
            str(ROOT / "tests/cuda/spin.cu"),
        ],
        env,
        300,
        "building tests/cuda/spin.cu with nvcc",
    )
    calls = out / "intercept_calls"
    run(
        [
            env.get("CC", "cc"),
            "-O2",
            "-std=c11",
            "-I",
            str(ROOT / "csrc/include"),
            str(ROOT / "bench/intercept_calls.c"),
            "-o",
            str(calls),
            "-ldl",
        ],
        env,
        120,
        "building bench/intercept_calls.c",
    )
    tools = Tools(
        burn=native_path("bin/cgpu-burn"),
        bypass=native_path("bin/cgpu-bypass"),
        spin=spin,
        calls=calls,
        libcgpu=native_path("lib/libcgpu.so"),
        runtime=native_path("bin/cgpu-runtime"),
    )
    for path in (tools.burn, tools.bypass, tools.libcgpu, tools.runtime):
        if not path.exists():
            raise CheckError(f"{path} is missing: install the project first (./dev gpu-check does)")
    return tools
