"""Every CUDA runtime line users run (12.9, 13.0, the newest 13.x; PyPI's
wheels, tests/harness/cudakit.py), shared and static cudart, on the simulated GPU:
device query, cudaMemGetInfo, malloc until refused, kernels from an
nvcc-built fatbin and from PTX, streams, events and a captured graph; bare,
and under `cgpuctl run --mem 1GiB --core 30`, seeing and holding 1 GiB and
about 30 %.

The programs are tests/cuda/runtime_steps.c, built by the host compiler
against each line's headers (PyPI has no nvcc for 12.x), and, for the lines
that ship nvcc, tests/cuda/spin.cu built by that line's own nvcc (its kernel
registered from the embedded fatbin, launched with <<<>>>). Each prints
"<step> <cudaError name> [values]"."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import cudakit
from tests.harness.cc import compile_strict
from tests.harness.sim import write_sim_config
from tests.harness.daemon import BIN, Daemon, running_daemon
from tests.harness.spin import build_spin, steps

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
MATRIX = [(line, cudart) for line in cudakit.LINES for cudart in ("shared", "static")]
NVCC_MATRIX = [(line, cudart) for line, cudart in MATRIX if cudakit.LINES[line].nvcc]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The spin kernel as a fatbin (PTX for compute_75 beside sm_80 machine
    code, which the simulated GPU cannot run) and as bare PTX, by the
    default line's nvcc."""
    out = tmp_path_factory.mktemp("kernels")
    nvcc = str(cudakit.toolkit().nvcc)
    src = str(ROOT / "tests/cuda/spin_kernel.cu")
    subprocess.run(
        [
            nvcc,
            "-fatbin",
            "-gencode",
            "arch=compute_75,code=compute_75",
            "-gencode",
            "arch=compute_80,code=sm_80",
            "-o",
            str(out / "spin.fatbin"),
            src,
        ],
        check=True,
        timeout=300,
    )
    subprocess.run([nvcc, "-ptx", "-arch=compute_75", "-o", str(out / "spin.ptx"), src], check=True, timeout=300)
    return {"fatbin": out / "spin.fatbin", "ptx": out / "spin.ptx"}


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """runtime_steps.c for every (line, cudart)."""
    out = tmp_path_factory.mktemp("runtime_steps")
    built = {}
    for line, cudart in MATRIX:
        exe = out / f"steps-{line}-{cudart}"
        compile_strict(exe, str(ROOT / "tests/cuda/runtime_steps.c"), *cudakit.toolkit(line).cc_flags(cudart))
        built[line, cudart] = exe
    return built


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory, native: Path) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("machine")
    return dict(
        os.environ,
        LD_LIBRARY_PATH=str(native / "sim"),
        CGPU_SIM_CONFIG=str(write_sim_config(tmp / "sim.conf")),
        CGPU_SIM_STATE=str(tmp / "sim.state"),
    )


@pytest.fixture(scope="module")
def cgpud(tmp_path_factory: pytest.TempPathFactory, machine: dict[str, str]) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("cgpud"), machine, "--mode", "core_mem") as d:
        assert d.cgpuctl("policy", "set", "fixed").returncode == 0
        yield d


def under_limits(d: Daemon) -> tuple[str, ...]:
    return (str(BIN / "cgpuctl"), "--socket", str(d.socket), "run", "--mem", "1GiB", "--core", "30", "--")


def assert_share(burn: list[str]) -> None:
    busy, wall = (int(v) for v in burn[1:])
    assert burn[0] == "cudaSuccess" and 0.22 <= busy / wall <= 0.40, burn


@pytest.mark.parametrize(("line", "cudart"), MATRIX)
def test_bare_the_runtime_sees_the_gpus_runs_kernels_from_fatbin_and_ptx_and_fills_16gib(
    programs, kernels, machine, line, cudart
):
    got = steps(
        programs[line, cudart],
        machine,
        "version",
        "count",
        "props",
        "meminfo",
        f"load={kernels['fatbin']}",
        "kernel",
        "events",
        "graph",
        f"load={kernels['ptx']}",
        "kernel",
        "fill",
    )
    # the runtime is the line asked for, on the driver version the simulated GPU reports
    assert got["version"] == ["cudaSuccess", "13000", str(cudakit.LINES[line].version)]
    assert got["count"] == ["cudaSuccess", "2"]
    assert got["props"] == ["cudaSuccess", "9.0", "132", str(16 * GIB)]
    assert got["meminfo"] == ["cudaSuccess", str(16 * GIB), str(16 * GIB)]
    assert got["load"] == got["load@last"] == ["cudaSuccess"]
    # the 50 ms kernel from the fatbin's PTX, then from bare PTX
    for key in ("kernel", "kernel@last"):
        assert got[key][0] == "cudaSuccess" and 49_000 <= int(got[key][1]) < 500_000, got[key]
    # 20 ms between two events on a stream; two 20 ms kernels as a graph
    assert got["events"][0] == "cudaSuccess" and 19_000 <= int(got["events"][1]) < 200_000, got["events"]
    assert got["graph"][0] == "cudaSuccess" and 39_000 <= int(got["graph"][1]) < 500_000, got["graph"]
    assert got["fill"] == ["cudaErrorMemoryAllocation", str(16 * GIB)]


@pytest.mark.parametrize(("line", "cudart"), MATRIX)
def test_under_cgpuctl_run_the_runtime_sees_1gib_stops_there_and_gets_30_percent(
    programs, kernels, cgpud, line, cudart
):
    got = steps(
        programs[line, cudart],
        cgpud.env,
        "meminfo",
        f"load={kernels['fatbin']}",
        "burn=3",
        "graph",
        "fill",
        "meminfo",
        prefix=under_limits(cgpud),
    )
    print(
        f"under limits, CUDA {line} {cudart}: total {got['meminfo'][2]} held {got['fill'][1]} "
        f"share {int(got['burn'][1]) / int(got['burn'][2]):.3f}"
    )
    assert got["meminfo"] == ["cudaSuccess", str(GIB), str(GIB)]
    assert got["load"] == ["cudaSuccess"]
    assert_share(got["burn"])
    assert got["graph"][0] == "cudaSuccess", got["graph"]
    assert got["fill"] == ["cudaErrorMemoryAllocation", str(GIB)]
    assert got["meminfo@last"] == ["cudaSuccess", "0", str(GIB)]


@pytest.fixture(scope="module")
def nvcc_programs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """spin.cu by each line's own nvcc, shared and static cudart."""
    out = tmp_path_factory.mktemp("nvcc")
    return {
        (line, cudart): build_spin(out / f"spin-{line}-{cudart}", "default", "compute_75", cudart, line=line)
        for line, cudart in NVCC_MATRIX
    }


@pytest.mark.parametrize(("line", "cudart"), NVCC_MATRIX)
def test_nvcc_built_programs_of_each_line_run_bare_and_under_limits(nvcc_programs, machine, cgpud, line, cudart):
    exe = nvcc_programs[line, cudart]
    got = steps(
        exe,
        machine,
        "count",
        "meminfo",
        "malloc",
        "async",
        "copy",
        "kernel",
        "graph",
        "capture",
        "reset",
        "device=1",
        "kernel",
    )
    assert got["count"] == ["cudaSuccess", "2"]
    assert got["meminfo"] == ["cudaSuccess", str(16 * GIB), str(16 * GIB)]
    assert got["malloc"] == got["async"] == ["cudaSuccess"] and got["copy"] == ["cudaSuccess", "1"]
    for key in ("kernel", "kernel@last"):
        assert got[key][0] == "cudaSuccess" and 49_000 <= int(got[key][1]) < 500_000, got[key]
    assert got["graph"][0] == "cudaSuccess" and 39_000 <= int(got["graph"][1]) < 500_000, got["graph"]
    assert got["capture"][0] == "cudaSuccess" and got["capture"][2] == "1", got["capture"]
    got = steps(exe, cgpud.env, "meminfo", "burn=3", "asyncfill", "fill", prefix=under_limits(cgpud))
    print(
        f"under limits, nvcc {line} {cudart}: total {got['meminfo'][2]} held {got['fill'][1]} "
        f"share {int(got['burn'][1]) / int(got['burn'][2]):.3f}"
    )
    assert got["meminfo"] == ["cudaSuccess", str(GIB), str(GIB)]
    assert_share(got["burn"])
    assert got["asyncfill"] == got["fill"] == ["cudaErrorMemoryAllocation", str(GIB)]
