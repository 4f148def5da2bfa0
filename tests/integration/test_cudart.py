"""Real CUDA programs on the simulated GPU: a C program linked against the
real libcudart.so.13 and a CUDA C++ program built here by nvcc
(tests/cuda/spin.cu: its spin kernel embedded as PTX in a fatbin), bare and
as tenants of `cgpuctl run --mem 1GiB --core 30`. Each program step prints
"<step> <cudaError name> [values]" (see spin.cu). The toolchain is the
default CUDA line's from PyPI (tests/harness/cudakit.py); every line's runtime:
test_cuda_runtimes.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.harness import cudakit, sanitizers
from tests.harness.daemon import BIN, running_daemon
from tests.harness.spin import build_spin, steps

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
MIB64 = 64 << 20

C_PROGRAM = r"""
#include <stdio.h>
#include <string.h>
#include <cuda_runtime_api.h>

/* The runtime API from plain C: devices, memory, and how far cudaMalloc goes. */
int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        cudaError_t rc;
        if (!strcmp(argv[i], "count")) {
            int n = -1;
            rc = cudaGetDeviceCount(&n);
            printf("count %s %d\n", cudaGetErrorName(rc), n);
        } else if (!strcmp(argv[i], "meminfo")) {
            size_t free_b = 0, total = 0;
            rc = cudaMemGetInfo(&free_b, &total);
            printf("meminfo %s %zu %zu\n", cudaGetErrorName(rc), free_b, total);
        } else {
            unsigned long long held = 0;
            void *p;
            while ((rc = cudaMalloc(&p, 64u << 20)) == cudaSuccess)
                held += 64u << 20;
            printf("fill %s %llu\n", cudaGetErrorName(rc), held);
        }
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("cudart_c")
    (tmp / "prog.c").write_text(C_PROGRAM)
    subprocess.run(
        [
            "cc",
            "-std=c11",
            "-Wall",
            "-Werror",
            "-o",
            str(tmp / "prog"),
            str(tmp / "prog.c"),
            *cudakit.toolkit().cc_flags("shared"),
        ],
        check=True,
    )
    return tmp / "prog"


@pytest.fixture(scope="module")
def spin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_spin(tmp_path_factory.mktemp("spin") / "spin", "default")


def test_c_program_on_the_real_runtime_sees_and_fills_the_simulated_gpus(c_program, sim_env):
    got = steps(c_program, sim_env, "count", "meminfo", "fill")
    assert got["count"] == ["cudaSuccess", "2"]
    assert got["meminfo"][0] == "cudaSuccess" and int(got["meminfo"][2]) == 16 * GIB
    assert got["fill"] == ["cudaErrorMemoryAllocation", str(16 * GIB)]


def test_nvcc_program_allocates_launches_and_runs_a_graph_through_cudart(spin, sim_env):
    got = steps(
        spin,
        sim_env,
        "count",
        "meminfo",
        "malloc",
        "async",
        "managed",
        "copy",
        "attrs",
        "kernel",
        "graph",
        "capture",
        "reset",
        "kernel",
        "device=1",
        "kernel",
        "graph",
    )
    assert got["count"] == ["cudaSuccess", "2"]
    assert got["meminfo"] == ["cudaSuccess", str(16 * GIB), str(16 * GIB)]
    for step in ("malloc", "free", "async", "freeasync", "managed"):
        assert got[step] == ["cudaSuccess"], step
    assert got["copy"] == ["cudaSuccess", "1"]
    # kernel attributes and occupancy go through the cuKernel* calls of lazy loading
    assert got["attrs"][:2] == ["cudaSuccess", "1024"] and int(got["attrs"][2]) > 0, got["attrs"]
    # the spin kernel is timed from its PTX: 50 ms, and the graph's two 20 ms nodes
    assert got["kernel"][0] == "cudaSuccess" and 49_000 <= int(got["kernel"][1]) < 500_000, got["kernel"]
    assert got["graph"][0] == "cudaSuccess" and 39_000 <= int(got["graph"][1]) < 500_000, got["graph"]
    # two kernels captured from a stream (capturing while they were queued) run as a 40 ms graph
    assert got["capture"][0] == "cudaSuccess" and got["capture"][2] == "1", got["capture"]
    assert 39_000 <= int(got["capture"][1]) < 500_000, got["capture"]
    # cudaDeviceReset, and the runtime starts over on the reset context; the
    # same kernel on the second GPU (its code loaded there on first use)
    assert got["reset"] == ["cudaSuccess"] and got["device"] == ["cudaSuccess"]
    assert got["kernel@last"][0] == got["graph@last"][0] == "cudaSuccess", got


@pytest.mark.parametrize("compress", ["none", "speed", "size"])
def test_the_spin_kernel_is_read_from_plain_lz4_and_zstd_fatbins(tmp_path, sim_env, compress):
    exe = build_spin(tmp_path / "spin", compress)
    got = steps(exe, sim_env, "kernel")
    assert got["kernel"][0] == "cudaSuccess" and 49_000 <= int(got["kernel"][1]) < 500_000, got["kernel"]


def test_the_static_runtime_nvcc_links_by_default_runs_too(tmp_path, sim_env):
    exe = build_spin(tmp_path / "spin", "default", cudart="static")
    got = steps(exe, sim_env, "count", "malloc", "kernel", "graph")
    assert [got[s][0] for s in ("count", "malloc", "kernel", "graph")] == ["cudaSuccess"] * 4


def test_per_thread_default_stream_and_eager_loading(tmp_path, sim_env):
    """Built with --default-stream per-thread cudart takes the _ptsz entry
    points; CUDA_MODULE_LOADING=EAGER loads code at start instead of first use."""
    exe = build_spin(tmp_path / "spin", "default", "compute_75", "shared", "--default-stream", "per-thread")
    for loading in ("LAZY", "EAGER"):
        got = steps(exe, dict(sim_env, CUDA_MODULE_LOADING=loading), "async", "kernel", "graph", "capture")
        assert [got[s][0] for s in ("async", "kernel", "graph", "capture")] == ["cudaSuccess"] * 4, (loading, got)
        assert 49_000 <= int(got["kernel"][1]) < 500_000, got["kernel"]


def test_machine_code_without_ptx_has_no_image_for_the_simulated_gpu(tmp_path, sim_env):
    """As on a GPU of another architecture: the simulation runs PTX only."""
    got = steps(build_spin(tmp_path / "spin", "default", code="sm_80"), sim_env, "malloc", "kernel")
    assert got["malloc"] == ["cudaSuccess"]
    assert got["kernel"][0] == "cudaErrorNoKernelImageForDevice"


def test_device_memory_through_cudart_is_what_the_simulated_gpu_counts(spin, sim_env, native):
    from tests.harness.simrun import sim_stat

    proc = subprocess.Popen([str(spin), "fill", "kernel"], env=sim_env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert f"fill cudaErrorMemoryAllocation {16 * GIB}" in out
    # the process is gone: what it held is back
    assert int(sim_stat(native, sim_env)["gpus"][0]["used"]) == 0


@pytest.fixture
def tenant_daemon(tmp_path, sim_env):
    with running_daemon(tmp_path, sim_env, "--mode", "core_mem") as d:
        assert d.cgpuctl("policy", "set", "fixed").returncode == 0
        yield d


def test_under_cgpuctl_run_cudart_sees_1gib_stops_there_and_gets_30_percent(tenant_daemon, spin, c_program):
    run = (str(BIN / "cgpuctl"), "--socket", str(tenant_daemon.socket), "run", "--mem", "1GiB", "--core", "30", "--")
    got = steps(
        spin, tenant_daemon.env, "meminfo", "burn=4", "capture", "asyncfill", "poolfill", "fill", "meminfo", prefix=run
    )
    assert got["meminfo"] == ["cudaSuccess", str(GIB), str(GIB)]
    # stream-ordered allocation, from the default pool and from one of its own:
    # held at 1 GiB too, and given back by cudaFreeAsync (fill gets it all)
    assert got["asyncfill"] == got["poolfill"] == ["cudaErrorMemoryAllocation", str(GIB)]
    assert got["fill"] == ["cudaErrorMemoryAllocation", str(GIB)]
    assert got["meminfo@last"] == ["cudaSuccess", "0", str(GIB)]
    busy, wall = (int(v) for v in got["burn"][1:])
    assert got["burn"][0] == "cudaSuccess"
    assert 0.22 <= busy / wall <= 0.40, (busy, wall)
    assert got["capture"][0] == "cudaSuccess" and got["capture"][2] == "1", got["capture"]
    # the plain C program under the same limit
    got = steps(c_program, tenant_daemon.env, "meminfo", "fill", prefix=run)
    assert got["meminfo"][0] == "cudaSuccess" and int(got["meminfo"][2]) == GIB
    assert got["fill"] == ["cudaErrorMemoryAllocation", str(GIB)]


@pytest.mark.parametrize("line", ["13.0", "13.5"])
def test_cudart_paths_are_clean_under_sanitizers(tmp_path, san_env, line):
    """Export tables, fatbin reading, libraries and kernels through the
    sanitized simulated driver, for the runtime of the driver's own version
    and the newest (the program itself is not instrumented: the ASan runtime
    is preloaded; cudart's own allocations are not ours to check)."""
    spin = build_spin(tmp_path / "spin", "default", line=line)
    env = sanitizers.python_env(san_env)
    proc = subprocess.run(
        [
            str(spin),
            "count",
            "meminfo",
            "malloc",
            "async",
            "managed",
            "kernel",
            "graph",
            "capture",
            "device=1",
            "kernel",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    assert proc.returncode == 0 and proc.stdout.count("cudaSuccess") == 13, proc.stdout + proc.stderr


FATBIN_ATTACKS = r"""
import ctypes as C, json, struct
from cudapy import Driver, SPIN_PTX
cu = Driver()
cu.init_device()

def entry(kind, payload, flags=0, header=0x40, size=None, packed=0, full=0):
    head = struct.pack("<HHIQII", kind, 0x101, header, len(payload) if size is None else size, packed, 0x40)
    head += struct.pack("<II", 0x90000, 75) + b"\0" * 8 + struct.pack("<Q", flags) + b"\0" * 8 + struct.pack("<Q", full)
    return head + b"\0" * (header - len(head)) + payload

def fatbin(entries, size=None):
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xba55ed50, 1, 16, len(body) if size is None else size) + body

ptx = SPIN_PTX + b"\0"
cases = {
    "good": fatbin([entry(1, ptx)]),
    "elf_only": fatbin([entry(2, b"\x7fELF" + b"\0" * 60)]),
    "entry_past_end": fatbin([entry(1, ptx, size=1 << 40)]),
    "header_past_end": fatbin([entry(1, ptx, header=0xfff0)], size=0x60),
    "files_past_end": fatbin([entry(1, ptx)], size=1 << 20)[:0x100],
    "short_header": fatbin([entry(1, ptx, header=8)]),
    "zstd_garbage": fatbin([entry(1, b"\x28\xb5\x2f\xfd" + b"\xff" * 60, flags=0x8000, packed=64, full=1 << 20)]),
    "lz4_garbage": fatbin([entry(1, b"\xff" * 64, flags=0x2000, packed=64, full=4096)]),
    "lz4_huge": fatbin([entry(1, b"\xff" * 64, flags=0x2000, packed=64, full=1 << 40)]),
    "packed_past_payload": fatbin([entry(1, b"\xff" * 64, flags=0x2000, packed=1 << 30, full=4096)]),
    "tiny": b"\x50\xed",
}
out = {}
for name, data in cases.items():
    buf = C.create_string_buffer(data, len(data) + 1)
    lib, mod = C.c_void_p(), C.c_void_p()
    out[name] = [cu.rc("cuLibraryLoadData", C.byref(lib), buf, None, None, 0, None, None, 0),
                 cu.rc("cuModuleLoadFatBinary", C.byref(mod), buf)]
    if lib.value:
        k = C.c_void_p()
        out[name].append(cu.rc("cuLibraryGetKernel", C.byref(k), lib, b"cgpu_spin"))
        cu.rc("cuLibraryUnload", lib)
print(json.dumps(out))
"""


def test_hostile_fatbins_are_refused_cleanly_by_the_sanitized_driver(san_env):
    """Fatbins a program could hand the driver, cut short, with sizes past
    their end, or compressed garbage: refused with an error, read nowhere
    past their bytes (the simulated driver built with ASan/UBSan)."""
    from tests.harness.simrun import run_py

    env = sanitizers.python_env(san_env)
    got = run_py(env, FATBIN_ATTACKS)
    assert got.pop("good") == ["CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_SUCCESS"]
    for name, rcs in got.items():
        assert rcs[:2] in (["CUDA_ERROR_NO_BINARY_FOR_GPU"] * 2, ["CUDA_ERROR_INVALID_PTX"] * 2), (name, rcs)


EVERY_ALLOCATOR = r"""
#include <stdio.h>
#include <string.h>
#include <cuda_runtime_api.h>

/* A tenant trying each allocator the runtime offers, 64 MiB at a time, each
 * until it fails, then giving it all back: prints "<kind> <error> <bytes>". */
int main(int argc, char **argv)
{
    static void *held[4096];
    for (int i = 1; i < argc; i++) {
        int n = 0;
        unsigned long long bytes = 0;
        cudaError_t rc = cudaSuccess;
        const size_t chunk = 64u << 20;
        while (rc == cudaSuccess && n < 4096) {
            void *p = NULL;
            if (!strcmp(argv[i], "managed")) {
                rc = cudaMallocManaged(&p, chunk, cudaMemAttachGlobal);
            } else if (!strcmp(argv[i], "pitch")) {
                size_t pitch = 0;
                rc = cudaMallocPitch(&p, &pitch, 1u << 20, 64);
            } else if (!strcmp(argv[i], "3d")) {
                struct cudaPitchedPtr pp;
                struct cudaExtent extent = {1u << 20, 8, 8};  /* make_cudaExtent is C++ */
                rc = cudaMalloc3D(&pp, extent);
                p = pp.ptr;
            } else if (!strcmp(argv[i], "pinned")) {
                rc = cudaMallocHost(&p, chunk);
                if (rc == cudaSuccess && bytes >= (2ull << 30)) {  /* host memory: 2 GiB is plenty */
                    held[n++] = p;
                    bytes += chunk;
                    break;
                }
            } else {
                return 2;
            }
            if (rc == cudaSuccess) {
                held[n++] = p;
                bytes += chunk;
            }
        }
        printf("%s %s %llu\n", argv[i], cudaGetErrorName(rc), bytes);
        (void)cudaGetLastError();
        for (int k = 0; k < n; k++)
            (void)(!strcmp(argv[i], "pinned") ? cudaFreeHost(held[k]) : cudaFree(held[k]));
    }
    return 0;
}
"""


def test_a_tenant_trying_every_runtime_allocator_stops_at_its_limit(tmp_path, tenant_daemon):
    """Managed, pitched and 3D allocations through cudart are device memory
    and stop at the instance's 1 GiB, each given back in full before the
    next; pinned host memory is not the GPU's and goes past it."""
    src, exe = tmp_path / "allocators.c", tmp_path / "allocators"
    src.write_text(EVERY_ALLOCATOR)
    subprocess.run(["cc", "-o", str(exe), str(src), *cudakit.toolkit().cc_flags("shared")], check=True)
    run = (str(BIN / "cgpuctl"), "--socket", str(tenant_daemon.socket), "run", "--mem", "1GiB", "--")
    got = steps(exe, tenant_daemon.env, "managed", "pitch", "3d", "pinned", "managed", prefix=run)
    for kind in ("managed", "pitch", "3d", "managed@last"):
        assert got[kind] == ["cudaErrorMemoryAllocation", str(GIB)], (kind, got[kind])
    assert got["pinned"][0] == "cudaSuccess" and int(got["pinned"][1]) > GIB, got["pinned"]
