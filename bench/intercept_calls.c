/* intercept_calls: the per-call cost of one CUDA driver entry point, for
 * bench/bench_intercept.py to compare the bare driver with the driver under
 * libcgpu.so (LD_PRELOAD).
 *
 *   intercept_calls MODE N [proc|dlsym]
 *
 * MODE is one of
 *   launch     N x cuLaunchKernel of a PTX kernel that spins for 0 ns (no
 *              device time, so the stream's queue never fills), on one
 *              stream, then one cuStreamSynchronize;
 *   allocfree  N x (cuMemAlloc_v2 of 1 MiB, cuMemFree_v2);
 *   meminfo    N x cuMemGetInfo_v2;
 *   vmm        N x (cuMemCreate of 2 MiB on device 0, cuMemMap into a range
 *              reserved once in setup, cuMemRelease, cuMemUnmap): released
 *              while mapped, so the unmap, the last reference, frees the
 *              memory. 2 MiB is rounded up to cuMemGetAllocationGranularity's
 *              minimum, asked once in setup (2 MiB on the simulation, so no
 *              change); the range is reserved (cuMemAddressReserve) before
 *              and freed (cuMemAddressFree) after the measured loops.
 *
 * The driver is loaded the way the CUDA runtime loads it: dlopen("libcuda.so.1"),
 * dlsym("cuGetProcAddress_v2"), then every function through cuGetProcAddress_v2
 * (or, with "dlsym", by dlsym on the handle), so a preloaded interception
 * library sees the calls as it would in a real application.
 *
 * After a warm-up of WARMUP calls, the N calls are timed with
 * clock_gettime(CLOCK_MONOTONIC) around the loop (and the final synchronize in
 * launch mode). Both the warm-up and the timed loop run in bench_measure(), so
 * whole-program instruction counts taken with two different N differ only by
 * the work of the extra calls.
 *
 * Prints one JSON object on stdout; "resolved_from" names the file that each
 * measured function pointer lives in, so the caller can check that the
 * interception applied. Exit codes: 0 done; 1 a CUDA call failed; 2 bad
 * argument or setup failure (one line on stderr). */
#define _GNU_SOURCE /* dladdr */

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cgpu/cuda_abi.h"
#include "cgpu/spin_kernel.h"

#define CUDA_TOOL_NAME "intercept_calls"
#include "cgpu/cuda_tool.h"

/* The base names below resolve, at this version, to the variants typed here. */
#define BENCH_CUDA_VERSION 12000
#define WARMUP 1000
#define ALLOC_BYTES ((size_t)1 << 20)
#define VMM_BYTES ((size_t)2 << 20) /* rounded up to the allocation granularity */

enum mode { M_LAUNCH, M_ALLOCFREE, M_MEMINFO, M_VMM };
static const char *const mode_names[] = {"launch", "allocfree", "meminfo", "vmm"};
#define NO_MODE (-1) /* a function no mode measures: setup, teardown, synchronize */

/* X(exported symbol, base name for cuGetProcAddress, the mode that measures
 * it or NO_MODE); "resolved_from" names the library of each one measured */
#define BENCH_FUNCTIONS(X)                                                    \
    X(cuInit, cuInit, NO_MODE)                                                \
    X(cuGetErrorName, cuGetErrorName, NO_MODE)                                \
    X(cuDeviceGet, cuDeviceGet, NO_MODE)                                      \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, NO_MODE)            \
    X(cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease, NO_MODE)       \
    X(cuCtxSetCurrent, cuCtxSetCurrent, NO_MODE)                              \
    X(cuModuleLoadData, cuModuleLoadData, NO_MODE)                            \
    X(cuModuleGetFunction, cuModuleGetFunction, NO_MODE)                      \
    X(cuModuleUnload, cuModuleUnload, NO_MODE)                                \
    X(cuStreamCreate, cuStreamCreate, NO_MODE)                                \
    X(cuStreamDestroy_v2, cuStreamDestroy, NO_MODE)                           \
    X(cuStreamSynchronize, cuStreamSynchronize, NO_MODE)                      \
    X(cuLaunchKernel, cuLaunchKernel, M_LAUNCH)                               \
    X(cuMemAlloc_v2, cuMemAlloc, M_ALLOCFREE)                                 \
    X(cuMemFree_v2, cuMemFree, M_ALLOCFREE)                                   \
    X(cuMemGetInfo_v2, cuMemGetInfo, M_MEMINFO)                               \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity, NO_MODE)  \
    X(cuMemAddressReserve, cuMemAddressReserve, NO_MODE)                      \
    X(cuMemAddressFree, cuMemAddressFree, NO_MODE)                            \
    X(cuMemCreate, cuMemCreate, M_VMM)                                        \
    X(cuMemMap, cuMemMap, M_VMM)                                              \
    X(cuMemRelease, cuMemRelease, M_VMM)                                      \
    X(cuMemUnmap, cuMemUnmap, M_VMM)

struct api {
#define X(sym, base, measured_in) __typeof__(&sym) sym;
    BENCH_FUNCTIONS(X)
#undef X
};

struct bench {
    enum mode mode;
    struct api f;
    CUfunction fn;
    CUstream stream;
    uint64_t kernel_ns; /* 0: the kernel's only parameter */
    void *params[1];
    CUmemAllocationProp vmm_prop; /* vmm: pinned, device 0 */
    size_t vmm_bytes;             /* vmm: VMM_BYTES rounded up to the granularity */
    CUdeviceptr vmm_va;           /* vmm: the reserved range, vmm_bytes long */
    const char *failed_call;
    CUresult failed_result;
};

static int load_driver(struct bench *b, int by_dlsym, void **handle)
{
    __typeof__(&cuGetProcAddress_v2) get_proc = NULL;
    void *pfn;
    int rc = open_driver(handle, &get_proc);
    if (rc)
        return rc;
    void *dl = *handle;
#define X(sym, base, measured_in)                                                              \
    {                                                                                          \
        CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;              \
        pfn = NULL;                                                                            \
        if (by_dlsym)                                                                          \
            pfn = dlsym(dl, #sym);                                                             \
        else if (get_proc(#base, &pfn, BENCH_CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &st) != \
                     CUDA_SUCCESS ||                                                           \
                 st != CU_GET_PROC_ADDRESS_SUCCESS)                                            \
            pfn = NULL;                                                                        \
        if (!pfn)                                                                              \
            return fail("cannot resolve %s (%s)", #sym, by_dlsym ? "dlsym" : "cuGetProcAddress"); \
        memcpy(&b->f.sym, &pfn, sizeof pfn);                                                   \
    }
    BENCH_FUNCTIONS(X)
#undef X
    return 0;
}

static CUresult record(struct bench *b, const char *call, CUresult r)
{
    if (r != CUDA_SUCCESS && !b->failed_call) {
        b->failed_call = call;
        b->failed_result = r;
    }
    return r;
}

/* The measured loop, used for the warm-up and for the timed calls, so that
 * the two differ only in n. Returns the wall time of the n calls (and, in
 * launch mode, of the synchronize that ends them). Kept out of line so that
 * it shows up under its own name in a profile. */
__attribute__((noinline)) uint64_t bench_measure(struct bench *b, uint64_t n);

uint64_t bench_measure(struct bench *b, uint64_t n)
{
    const struct api *f = &b->f;
    struct timespec t0, t1;
    CUresult r = CUDA_SUCCESS;
    CUdeviceptr p;
    size_t free_b, total_b;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    switch (b->mode) {
    case M_LAUNCH:
        for (uint64_t i = 0; i < n && r == CUDA_SUCCESS; i++)
            r = record(b, "cuLaunchKernel",
                       f->cuLaunchKernel(b->fn, 1, 1, 1, 1, 1, 1, 0, b->stream, b->params, NULL));
        record(b, "cuStreamSynchronize", f->cuStreamSynchronize(b->stream));
        break;
    case M_ALLOCFREE:
        for (uint64_t i = 0; i < n && r == CUDA_SUCCESS; i++) {
            r = record(b, "cuMemAlloc_v2", f->cuMemAlloc_v2(&p, ALLOC_BYTES));
            if (r == CUDA_SUCCESS)
                r = record(b, "cuMemFree_v2", f->cuMemFree_v2(p));
        }
        break;
    case M_MEMINFO:
        for (uint64_t i = 0; i < n && r == CUDA_SUCCESS; i++)
            r = record(b, "cuMemGetInfo_v2", f->cuMemGetInfo_v2(&free_b, &total_b));
        break;
    case M_VMM:
        for (uint64_t i = 0; i < n && r == CUDA_SUCCESS; i++) {
            CUmemGenericAllocationHandle h;
            r = record(b, "cuMemCreate", f->cuMemCreate(&h, b->vmm_bytes, &b->vmm_prop, 0));
            if (r != CUDA_SUCCESS)
                break;
            r = record(b, "cuMemMap", f->cuMemMap(b->vmm_va, b->vmm_bytes, 0, h, 0));
            /* Released while mapped: the unmap frees the memory. */
            CUresult rel = record(b, "cuMemRelease", f->cuMemRelease(h));
            if (r == CUDA_SUCCESS)
                r = record(b, "cuMemUnmap", f->cuMemUnmap(b->vmm_va, b->vmm_bytes));
            if (r == CUDA_SUCCESS)
                r = rel;
        }
        break;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (uint64_t)(t1.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)t1.tv_nsec -
           (uint64_t)t0.tv_nsec;
}

/* The file a function pointer lives in: the driver, or the library that
 * intercepted it. */
static const char *origin(void (*fp)(void))
{
    Dl_info info;
    void *p;
    memcpy(&p, &fp, sizeof p);
    return dladdr(p, &info) && info.dli_fname ? info.dli_fname : "?";
}

/* `"fn":"<library>"` for each function of the measured mode. */
static void print_origins(const struct bench *b)
{
    const char *sep = "";
    printf("\"resolved_from\":{");
#define X(sym, base, measured_in)                               \
    if ((measured_in) == (int)b->mode) {                        \
        printf("%s\"" #sym "\":", sep);                         \
        json_str(origin((void (*)(void))b->f.sym));             \
        sep = ",";                                              \
    }
    BENCH_FUNCTIONS(X)
#undef X
    printf("}");
}

static int usage(void)
{
    fprintf(stderr, "usage: intercept_calls launch|allocfree|meminfo|vmm N [proc|dlsym]\n");
    return 2;
}

int main(int argc, char **argv)
{
    static struct bench b;
    void *dl = NULL;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod = NULL;
    char *end;
    int rc, by_dlsym = 0;

    if (argc < 3 || argc > 4)
        return usage();
    for (b.mode = M_LAUNCH; b.mode <= M_VMM; b.mode++)
        if (strcmp(argv[1], mode_names[b.mode]) == 0)
            break;
    if (b.mode > M_VMM || argv[2][0] < '0' || argv[2][0] > '9')
        return usage();
    errno = 0;
    uint64_t n = strtoull(argv[2], &end, 10);
    if (*end || errno || n == 0)
        return usage();
    if (argc == 4 && !(by_dlsym = strcmp(argv[3], "dlsym") == 0) && strcmp(argv[3], "proc") != 0)
        return usage();

    if ((rc = load_driver(&b, by_dlsym, &dl)))
        return rc;
    SETUP(&b, "cuInit", b.f.cuInit(0));
    SETUP(&b, "cuDeviceGet", b.f.cuDeviceGet(&dev, 0));
    SETUP(&b, "cuDevicePrimaryCtxRetain", b.f.cuDevicePrimaryCtxRetain(&ctx, dev));
    SETUP(&b, "cuCtxSetCurrent", b.f.cuCtxSetCurrent(ctx));
    if (b.mode == M_LAUNCH) {
        SETUP(&b, "cuModuleLoadData", b.f.cuModuleLoadData(&mod, cgpu_spin_ptx));
        SETUP(&b, "cuModuleGetFunction", b.f.cuModuleGetFunction(&b.fn, mod, CGPU_SPIN_ENTRY));
        SETUP(&b, "cuStreamCreate", b.f.cuStreamCreate(&b.stream, CU_STREAM_DEFAULT));
        b.params[0] = &b.kernel_ns;
    }
    if (b.mode == M_VMM) {
        b.vmm_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        b.vmm_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        b.vmm_prop.location.id = dev;
        size_t gran = 0;
        SETUP(&b, "cuMemGetAllocationGranularity",
              b.f.cuMemGetAllocationGranularity(&gran, &b.vmm_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        if (gran == 0)
            return fail("cuMemGetAllocationGranularity reported 0 bytes");
        b.vmm_bytes = (VMM_BYTES + gran - 1) / gran * gran;
        SETUP(&b, "cuMemAddressReserve", b.f.cuMemAddressReserve(&b.vmm_va, b.vmm_bytes, 0, 0, 0));
    }

    bench_measure(&b, WARMUP);
    uint64_t ns = b.failed_call ? 0 : bench_measure(&b, n);

    printf("{\"mode\":\"%s\",\"calls\":%llu,\"warmup\":%d,\"resolve\":\"%s\",", mode_names[b.mode],
           (unsigned long long)n, WARMUP, by_dlsym ? "dlsym" : "proc");
    printf("\"total_ns\":%llu,\"ns_per_call\":%.3f,", (unsigned long long)ns, (double)ns / (double)n);
    if (b.mode == M_VMM)
        printf("\"bytes\":%zu,", b.vmm_bytes);
    print_origins(&b);
    printf(",\"error\":");
    if (b.failed_call)
        printf("{\"call\":\"%s\",\"result\":\"%s\"}}\n", b.failed_call,
               result_name(b.f.cuGetErrorName, b.failed_result));
    else
        printf("null}\n");
    fflush(stdout);

    if (b.stream)
        b.f.cuStreamDestroy_v2(b.stream);
    if (mod)
        b.f.cuModuleUnload(mod);
    if (b.vmm_va)
        b.f.cuMemAddressFree(b.vmm_va, b.vmm_bytes);
    b.f.cuDevicePrimaryCtxRelease_v2(dev);
    dlclose(dl);
    return b.failed_call ? 1 : 0;
}
