"""Every way a program reaches the driver leads through libcgpu.so's hooks:
linking, dlopen + dlsym, dlvsym, dlsym(RTLD_NEXT), cuGetProcAddress v1/v2
for each CUDA version and stream flavour, and the pointer it gives for
itself; everything else reaches the driver untouched."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import cudakit
from tests.harness.simrun import run_py
from tests.harness.cc import build_c
from tests.harness.cuda_entry_points import ALLOC_PATTERN, ALLOCATING_IN_CUDART, HOOKED, NOT_INSTANCE_MEMORY
from tests.harness.grants import GIB

ROOT = Path(__file__).resolve().parents[2]

PROC_CASES = [
    # (base name, cudaVersion, flags, the exported variant the driver picks)
    ("cuMemAlloc", 11000, 0, "cuMemAlloc_v2"),
    ("cuMemAlloc", 12000, 0, "cuMemAlloc_v2"),
    ("cuMemAlloc", 13000, 0, "cuMemAlloc_v2"),
    ("cuMemAllocAsync", 12000, 0, "cuMemAllocAsync"),
    ("cuMemAllocAsync", 12000, 2, "cuMemAllocAsync_ptsz"),
    ("cuMemAllocFromPoolAsync", 13000, 2, "cuMemAllocFromPoolAsync_ptsz"),
    ("cuMemFreeAsync", 11020, 2, "cuMemFreeAsync_ptsz"),
    ("cuLaunchKernel", 11000, 0, "cuLaunchKernel"),
    ("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz"),
    ("cuGraphLaunch", 13000, 2, "cuGraphLaunch_ptsz"),
    ("cuMemGetInfo", 13000, 0, "cuMemGetInfo_v2"),
    ("cuArrayCreate", 12000, 0, "cuArrayCreate_v2"),
    ("cuGetProcAddress", 11030, 0, "cuGetProcAddress"),
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
    # Not hooked: the driver's own function, untouched.
    ("cuCtxCreate", 13000, 0, "cuCtxCreate_v4"),
    ("cuStreamSynchronize", 12000, 2, "cuStreamSynchronize_ptsz"),
]


def test_get_proc_address_returns_our_hook_for_the_variant_the_driver_picks(instance, libcgpu):
    got = run_py(
        instance({0: GIB}),
        f"""
        import ctypes as C, json; from cudapy import Driver
        cu = Driver(); ours = C.CDLL({str(libcgpu)!r})
        real = C.CDLL("libcuda.so.1", mode=C.RTLD_LOCAL)
        import _ctypes
        out = []
        for base, version, flags, exported in {PROC_CASES!r}:
            rc, addr, status = cu.proc_address(base, version, flags)
            hooked = hasattr(ours, exported) and addr == C.cast(getattr(ours, exported), C.c_void_p).value
            out.append([rc, status, hooked])
        print(json.dumps(out))
    """,
    )
    for case, result in zip(PROC_CASES, got):
        assert result == ["CUDA_SUCCESS", 0, case[3] in HOOKED], case


GET_PROC_ITSELF = r"""
#include <dlfcn.h>
#include <stdio.h>
#include "cgpu/cuda_abi.h"

/* The CUDA runtime's way in: dlsym only cuGetProcAddress_v2, ask it for
 * itself (v1 and v2 flavours), then for everything else through that. */
int main(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    __typeof__(&cuGetProcAddress_v2) gpa = (__typeof__(&cuGetProcAddress_v2))dlsym(h, "cuGetProcAddress_v2");
    void *self2 = NULL, *self1 = NULL, *alloc = NULL, *init = NULL, *ctx = NULL, *setctx = NULL;
    gpa("cuGetProcAddress", &self2, 12000, 0, NULL);
    gpa("cuGetProcAddress", &self1, 11030, 0, NULL);
    __typeof__(&cuGetProcAddress) v1 = (__typeof__(&cuGetProcAddress))self1;
    v1("cuMemAlloc", &alloc, 11030, 0);
    ((__typeof__(&cuGetProcAddress_v2))self2)("cuInit", &init, 12000, 0, NULL);
    v1("cuDevicePrimaryCtxRetain", &ctx, 11030, 0);
    v1("cuCtxSetCurrent", &setctx, 11030, 0);
    CUcontext c;
    ((__typeof__(&cuInit))init)(0);
    ((__typeof__(&cuDevicePrimaryCtxRetain))ctx)(&c, 0);
    ((__typeof__(&cuCtxSetCurrent))setctx)(c);
    CUdeviceptr p;
    int granted = 0;
    while (((__typeof__(&cuMemAlloc_v2))alloc)(&p, 256u << 20) == CUDA_SUCCESS)
        granted++;
    void *ours = dlopen("libcgpu.so", RTLD_NOW | RTLD_NOLOAD);
    printf("[%d, %d, %d]\n", self2 == dlsym(ours, "cuGetProcAddress_v2"), self1 == dlsym(ours, "cuGetProcAddress"),
           granted);
    return 0;
}
"""


def test_the_pointer_for_get_proc_address_itself_is_hooked(tmp_path, instance, native):
    exe = build_c(tmp_path, GET_PROC_ITSELF, "gpa", f"-I{ROOT / 'csrc/include'}", "-ldl")
    out = subprocess.run([str(exe)], env=instance({0: GIB}), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [1, 1, 4]


LINKED = r"""
#include <stdio.h>
#include "cgpu/cuda_abi.h"

/* Linked against libcuda.so.1 like most programs built with nvcc. */
int main(void)
{
    CUcontext c;
    CUdeviceptr p;
    size_t free_b, total;
    int n = 0;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&c, 0) || cuCtxSetCurrent(c))
        return 2;
    while (cuMemAlloc_v2(&p, 256u << 20) == CUDA_SUCCESS)
        n++;
    cuMemGetInfo_v2(&free_b, &total);
    printf("[%d, %zu]\n", n, total >> 20);
    return 0;
}
"""


def test_a_program_linked_against_libcuda_is_limited(tmp_path, instance, native):
    exe = build_c(tmp_path, LINKED, "linked", f"-I{ROOT / 'csrc/include'}", f"-L{native / 'sim'}", "-l:libcuda.so.1")
    out = subprocess.run([str(exe)], env=instance({0: GIB}), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [4, 1024]


NEXT_LIB = r"""
#define _GNU_SOURCE
#include <dlfcn.h>

/* vgpu-manager's bypass: RTLD_NEXT straight past an interposed dlsym. */
void *probe_next(void) { return dlsym(RTLD_NEXT, "cuMemAlloc_v2"); }
void *probe_vnext(void) { return dlvsym(RTLD_NEXT, "cuMemAlloc_v2", "GLIBC_2.2.5"); }
void *probe_next_untouched(void) { return dlsym(RTLD_NEXT, "cuCtxSynchronize"); }
"""


def test_dlsym_dlvsym_and_rtld_next_lead_to_the_hooks(tmp_path, instance, libcgpu):
    lib = build_c(tmp_path, NEXT_LIB, "libprobe.so", "-shared", "-fPIC", "-ldl")
    got = run_py(
        instance({0: GIB}),
        f"""
        import ctypes as C, json
        probe = C.CDLL({str(lib)!r})              # loaded before the driver: RTLD_NEXT reaches it
        cuda = C.CDLL("libcuda.so.1")
        ours = C.CDLL({str(libcgpu)!r})
        libc = C.CDLL(None)
        hook = C.cast(ours.cuMemAlloc_v2, C.c_void_p).value
        for f in (probe.probe_next, probe.probe_vnext, probe.probe_next_untouched):
            f.restype = C.c_void_p
        libc.dlvsym.restype = C.c_void_p
        libc.dlvsym.argtypes = [C.c_void_p, C.c_char_p, C.c_char_p]
        # The driver's symbols carry no version, so glibc's dlvsym finds none
        # of them by a versioned name: the only acceptable answers are
        # "nothing" and our hook, never the driver's own function.
        print(json.dumps([
            C.cast(cuda.cuMemAlloc_v2, C.c_void_p).value == hook,          # dlopen + dlsym (ctypes)
            libc.dlvsym(cuda._handle, b"cuMemAlloc_v2", b"GLIBC_2.2.5") in (None, hook),
            probe.probe_next() == hook,
            probe.probe_vnext() in (None, hook),
            probe.probe_next_untouched() == C.cast(cuda.cuCtxSynchronize, C.c_void_p).value,
        ]))
    """,
    )
    assert got == [True, True, True, True, True]


@pytest.mark.parametrize("line", list(cudakit.LINES))
def test_every_allocating_entry_point_of_cudart_is_accounted(line):
    """The driver names every runtime line users run can ask for (12.9 to
    the newest 13.x), read from its libcudart: each allocating one hooked or
    said why not."""
    cudart = cudakit.toolkit(line).cudart
    text = subprocess.run(["strings", str(cudart)], capture_output=True, text=True, check=True).stdout
    names = {n for n in text.split() if re.fullmatch(r"cu[A-Z]\w+", n)}
    assert len(names) > 400
    candidates = {n for n in names if ALLOC_PATTERN.match(n) and "Unregister" not in n and "Get" not in n[2:5]}
    unclassified = candidates - ALLOCATING_IN_CUDART.keys() - NOT_INSTANCE_MEMORY.keys()
    assert not unclassified, f"classify these driver entry points: {sorted(unclassified)}"
    assert all(hook in HOOKED for hook in ALLOCATING_IN_CUDART.values())
    assert "cuMemCreate" in HOOKED  # virtual memory management, used by NCCL and PyTorch
