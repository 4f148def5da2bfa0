"""A thin ctypes view of the CUDA driver API for test programs: tests run
small scripts in subprocesses (each with its own simulated-GPU environment)
that import this module. It speaks only the real driver ABI."""

from __future__ import annotations

import ctypes as C

SPIN_PTX = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry cgpu_spin(.param .u64 ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
    add.s64 %rd3, %rd2, %rd1;
$Lspin:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra $Lspin;
    ret;
}
"""

CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2


class CudaError(Exception):
    def __init__(self, what: str, code: int, name: str) -> None:
        super().__init__(f"{what}: {name} ({code})")
        self.code = code
        self.name = name


class Driver:
    def __init__(self, path: str = "libcuda.so.1") -> None:
        self.lib = C.CDLL(path)

    def error_name(self, code: int) -> str:
        s = C.c_char_p()
        if self.lib.cuGetErrorName(code, C.byref(s)) != 0:
            return f"unknown error {code}"
        return (s.value or b"").decode()

    def call(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise CudaError(name, rc, self.error_name(rc))

    def rc(self, name: str, *args: object) -> str:
        """Result name of a call that may fail."""
        return self.error_name(getattr(self.lib, name)(*args))

    def init_device(self, dev: int = 0) -> C.c_void_p:
        self.call("cuInit", 0)
        ctx = C.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", C.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        return ctx

    def mem_info(self) -> tuple[int, int]:
        free, total = C.c_size_t(), C.c_size_t()
        self.call("cuMemGetInfo_v2", C.byref(free), C.byref(total))
        return free.value, total.value

    def alloc(self, size: int) -> tuple[str, int]:
        ptr = C.c_uint64()
        return self.rc("cuMemAlloc_v2", C.byref(ptr), C.c_size_t(size)), ptr.value

    def spin_function(self) -> C.c_void_p:
        mod, fn = C.c_void_p(), C.c_void_p()
        self.call("cuModuleLoadData", C.byref(mod), C.c_char_p(SPIN_PTX))
        self.call("cuModuleGetFunction", C.byref(fn), mod, b"cgpu_spin")
        return fn

    def launch_spin(self, fn: C.c_void_p, ns: int, stream: object = None, name: str = "cuLaunchKernel") -> None:
        arg = C.c_uint64(ns)
        params = (C.c_void_p * 1)(C.cast(C.pointer(arg), C.c_void_p))
        self.call(name, fn, 1, 1, 1, 32, 1, 1, 0, stream, params, None)

    def event(self, flags: int = 0) -> C.c_void_p:
        ev = C.c_void_p()
        self.call("cuEventCreate", C.byref(ev), flags)
        return ev

    def elapsed_ms(self, start: C.c_void_p, end: C.c_void_p) -> float:
        ms = C.c_float()
        self.call("cuEventElapsedTime", C.byref(ms), start, end)
        return ms.value

    def proc_address(self, symbol: str, version: int, flags: int = 0) -> tuple[str, int | None, int]:
        """(result name, function address, query status) of cuGetProcAddress_v2."""
        pfn, status = C.c_void_p(), C.c_int(-1)
        rc = self.lib.cuGetProcAddress_v2(symbol.encode(), C.byref(pfn), version, C.c_uint64(flags), C.byref(status))
        return self.error_name(rc), pfn.value, status.value

    def address_of(self, exported: str) -> int:
        return C.cast(getattr(self.lib, exported), C.c_void_p).value
