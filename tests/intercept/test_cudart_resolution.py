"""The entry points the real CUDA runtimes resolve, listed from a traced run
of each (every cuGetProcAddress request while libcudart of 12.9, 13.0 and the
newest 13.x starts on the simulated GPU), and where each one lands under
libcgpu.so: every request for a name that allocates device memory, launches
work, shows memory or waits for work gets libcgpu's hook for the variant the
driver picks, whatever version and stream flavour cudart asks for. A CUDA
release whose runtime asks for a new such name fails here until it is
classified and hooked."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import cudakit
from tests.harness.cc import compile_strict
from tests.harness.sim import write_sim_config
from tests.harness.simrun import run_py
from tests.harness.grants import GIB
from tests.harness.cuda_entry_points import ALLOC_PATTERN, ALLOCATING_IN_CUDART, HOOKED, NOT_INSTANCE_MEMORY

ROOT = Path(__file__).resolve().parents[2]

LAUNCH_PATTERN = re.compile(r"^cu\w*Launch\w*$")
# Launch-named entry points that put no device work on the GPU, with the reason.
NOT_DEVICE_WORK = {"cuLaunchHostFunc": "runs a host function in stream order: no device time"}
# Not allocations or launches, but libcgpu must see them on every path too:
# the memory a tenant is shown, and the waits that say a process is idle.
VIEWS_AND_WAITS = {
    "cuMemGetInfo",
    "cuDeviceTotalMem",
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuEventSynchronize",
    "cuEventQuery",
}

STARTS_CUDART = r"""
#include <stdio.h>
#include <cuda_runtime_api.h>

/* cudart resolves every driver entry point it may use at its first call. */
int main(void)
{
    int n = -1;
    cudaError_t rc = cudaGetDeviceCount(&n);
    printf("%s %d\n", cudaGetErrorName(rc), n);
    return rc != cudaSuccess;
}
"""


@pytest.fixture(scope="module", params=list(cudakit.LINES))
def kit(request: pytest.FixtureRequest) -> cudakit.Toolkit:
    return cudakit.toolkit(request.param)


@pytest.fixture(scope="module")
def cudart_requests(
    tmp_path_factory: pytest.TempPathFactory, native: Path, kit: cudakit.Toolkit
) -> list[tuple[str, int, int]]:
    """Every (name, cudaVersion, flags) the line's libcudart asks the driver
    for while it starts, in order, traced on the simulated GPU by
    tests/cuda/gpa_tracer.c (preloaded)."""
    tmp = tmp_path_factory.mktemp("cudart")
    src = tmp / "starts.c"
    src.write_text(STARTS_CUDART)
    exe, tracer = tmp / "starts", tmp / "libgpa_tracer.so"
    subprocess.run(["cc", "-o", str(exe), str(src), *kit.cc_flags("shared")], check=True)
    compile_strict(tracer, "-shared", "-fPIC", str(ROOT / "tests/cuda/gpa_tracer.c"), "-ldl")
    env = dict(
        os.environ,
        LD_LIBRARY_PATH=str(native / "sim"),
        LD_PRELOAD=str(tracer),
        CGPU_SIM_CONFIG=str(write_sim_config(tmp / "sim.conf")),
        CGPU_SIM_STATE=str(tmp / "sim.state"),
    )
    out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout == "cudaSuccess 2\n", out.stdout + out.stderr[-3000:]
    # cudart's first request is for an empty name (a probe): not an entry point
    found = re.findall(r"^GPA (\w+) (\d+) (\d+)$", out.stderr, re.MULTILINE)
    return [(name, int(version), int(flags)) for name, version, flags in found]


def must_be_hooked(names: set[str]) -> tuple[set[str], set[str]]:
    """The names libcgpu must answer, and the allocation-like ones no rule classifies."""
    alloc = {n for n in names if ALLOC_PATTERN.match(n) and "Unregister" not in n and "Get" not in n[2:5]}
    unclassified = alloc - ALLOCATING_IN_CUDART.keys() - NOT_INSTANCE_MEMORY.keys()
    launch = {n for n in names if LAUNCH_PATTERN.match(n)} - NOT_DEVICE_WORK.keys()
    return (names & ALLOCATING_IN_CUDART.keys()) | launch | (names & VIEWS_AND_WAITS), unclassified


RESOLVE = """
    import ctypes as C, json, sys
    class DlInfo(C.Structure):
        _fields_ = [("fname", C.c_char_p), ("fbase", C.c_void_p), ("sname", C.c_char_p), ("saddr", C.c_void_p)]
    libc = C.CDLL(None)
    libc.dladdr.argtypes = [C.c_void_p, C.POINTER(DlInfo)]
    cu = C.CDLL("libcuda.so.1")
    cu.cuInit(0)
    gpa = cu.cuGetProcAddress_v2
    gpa.argtypes = [C.c_char_p, C.POINTER(C.c_void_p), C.c_int, C.c_uint64, C.POINTER(C.c_int)]
    out = []
    for name, version, flags in {requests!r}:
        fn, status = C.c_void_p(), C.c_int()
        rc = gpa(name.encode(), C.byref(fn), version, flags, C.byref(status))
        info = DlInfo()
        found = fn.value and libc.dladdr(fn.value, C.byref(info))
        out.append([rc, info.fname.decode().rsplit("/", 1)[-1] if found else None,
                    info.sname.decode() if found and info.sname else None])
    print(json.dumps(out))
"""


def interop_names(kit: cudakit.Toolkit) -> set[str]:
    text = "".join(kit.header(h).read_text() for h in ("cudaGL.h", "cudaEGL.h", "cudaVDPAU.h", "cudaProfiler.h"))
    return set(re.findall(r"CUresult CUDAAPI (cu\w+)\(", text))


def resolve_all(env: dict[str, str], requests: list[tuple[str, int, int]]) -> list[list]:
    return run_py(env, RESOLVE.format(requests=requests), timeout=120)


def test_cudart_asks_for_hundreds_of_names_and_the_simulator_answers_each(cudart_requests, sim_env, kit):
    names = {name for name, _, _ in cudart_requests}
    assert len(cudart_requests) >= 400 and len(names) >= 300, len(cudart_requests)
    assert "cuGetExportTable" in names  # the private tables: csrc/simgpu/export_tables.c
    bare = resolve_all(sim_env, cudart_requests)
    unanswered = {req[0] for req, (rc, lib, _) in zip(cudart_requests, bare) if rc != 0 or lib is None}
    # Only the graphics-interop and profiler entry points, which cudaGL.h,
    # cudaEGL.h, cudaVDPAU.h and cudaProfiler.h declare, not cuda.h: a
    # driver without them answers "not found" and cudart goes on.
    assert unanswered == unanswered & interop_names(kit), sorted(unanswered - interop_names(kit))
    assert len(unanswered) < len(names) // 10


def test_every_allocating_launching_or_viewing_name_cudart_resolves_lands_on_libcgpu(
    cudart_requests, sim_env, instance, kit
):
    names = {name for name, _, _ in cudart_requests}
    hooked, unclassified = must_be_hooked(names)
    assert not unclassified, f"classify these driver entry points cudart resolves: {sorted(unclassified)}"
    assert {
        "cuMemAlloc",
        "cuMemAllocAsync",
        "cuMemAllocManaged",
        "cuLaunchKernel",
        "cuGraphLaunch",
        "cuMemGetInfo",
    } <= hooked
    wanted = [req for req in cudart_requests if req[0] in hooked]
    bare = resolve_all(sim_env, wanted)
    under = resolve_all(instance({0: GIB}), wanted)
    wrong = []
    for req, (rc0, _, driver_sym), (rc1, lib, sym) in zip(wanted, bare, under):
        assert rc0 == rc1 == 0, req
        if lib != "libcgpu.so" or sym != driver_sym or sym not in HOOKED:
            wrong.append((*req, driver_sym, lib, sym))
    assert not wrong, f"(name, version, flags, driver's symbol, answered by, symbol): {wrong}"
    # both stream flavours and the versions each line asks were seen:
    # CUDA 13's cuCtxSynchronize_v2, 12's first version
    assert any(flags == 2 for name, _, flags in wanted if name == "cuLaunchKernel")
    assert ("cuCtxSynchronize", 13000 if kit.line.version >= 13000 else 2000, 0) in wanted


def test_figures_of_what_cudart_resolves(cudart_requests, sim_env, instance, kit):
    """How many of cudart's names the simulator models, stubs, and libcgpu
    intercepts (docs/simulated-gpu.md quotes these)."""
    modelled = set(
        re.findall(r"^CU_FN\(\w+, (\w+),", (ROOT / "csrc/include/cgpu/cuda_functions.def").read_text(), re.MULTILINE)
    )
    stubbed = set(
        re.findall(r"^CU_PROC\(\w+, (\w+),", (ROOT / "csrc/simgpu/cuda_unmodelled.def").read_text(), re.MULTILINE)
    )
    names = {name for name, _, _ in cudart_requests}
    under = resolve_all(instance({0: GIB}), cudart_requests)
    intercepted = {req[0] for req, (_, lib, _) in zip(cudart_requests, under) if lib == "libcgpu.so"}
    figures = {
        "line": kit.line.name,
        "requests": len(cudart_requests),
        "names": len(names),
        "modelled": len(names & modelled),
        "stubbed": len(names & stubbed - modelled),
        "not_found": len(names - modelled - stubbed),
        "intercepted": len(intercepted),
    }
    print(json.dumps(figures))
    assert names - modelled - stubbed <= interop_names(kit)
    assert intercepted <= names and len(intercepted) >= 20
