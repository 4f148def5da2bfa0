/* cgpu-burn: a GPU workload that uses only the CUDA driver API, so the same
 * binary allocates and computes the same way on a real NVIDIA GPU, under
 * libcgpu.so, and on the simulated driver. It loads libcuda like the CUDA
 * runtime does (dlopen, then cuGetProcAddress for everything else), allocates
 * through one chosen API, runs a PTX kernel that spins for a given time, and
 * prints exactly one JSON object on stdout for tests and benchmarks to read.
 *
 * Exit codes: 0 done; 1 a CUDA error while running or freeing (listed in
 * "errors"); 2 bad argument or setup failure (one line on stderr, no JSON);
 * 3 --require-alloc and an allocation failed. */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cgpu/cuda_abi.h"
#include "cgpu/spin_kernel.h"

#define CUDA_TOOL_NAME "cgpu-burn"
#include "cgpu/cuda_tool.h"

/* Fixed rather than CUDA_VERSION: each base name must resolve to the variant
 * whose prototype is typed below, whichever header this is compiled with
 * (12000 gives cuGraphAddKernelNode_v2 and cuGraphInstantiateWithFlags). */
#define BURN_CUDA_VERSION 12000
#define MAX_ALLOCS 64
#define MAX_STREAMS 64
#define MAX_ERRORS 16

/* X(exported symbol, base name for cuGetProcAddress, has a _ptsz variant) */
#define BURN_FUNCTIONS(X)                                              \
    X(cuInit, cuInit, 0)                                               \
    X(cuGetErrorName, cuGetErrorName, 0)                               \
    X(cuDeviceGet, cuDeviceGet, 0)                                     \
    X(cuDeviceGetName, cuDeviceGetName, 0)                             \
    X(cuDeviceGetUuid_v2, cuDeviceGetUuid, 0)                          \
    X(cuDeviceTotalMem_v2, cuDeviceTotalMem, 0)                        \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 0)           \
    X(cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease, 0)      \
    X(cuCtxSetCurrent, cuCtxSetCurrent, 0)                             \
    X(cuCtxSynchronize, cuCtxSynchronize, 0)                           \
    X(cuMemGetInfo_v2, cuMemGetInfo, 0)                                \
    X(cuMemAlloc_v2, cuMemAlloc, 0)                                    \
    X(cuMemAllocPitch_v2, cuMemAllocPitch, 0)                          \
    X(cuMemAllocManaged, cuMemAllocManaged, 0)                         \
    X(cuMemFree_v2, cuMemFree, 0)                                      \
    X(cuMemAllocAsync, cuMemAllocAsync, 1)                             \
    X(cuMemFreeAsync, cuMemFreeAsync, 1)                               \
    X(cuMemPoolCreate, cuMemPoolCreate, 0)                             \
    X(cuMemPoolDestroy, cuMemPoolDestroy, 0)                           \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 1)             \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity, 0) \
    X(cuMemCreate, cuMemCreate, 0)                                     \
    X(cuMemRelease, cuMemRelease, 0)                                   \
    X(cuMemAddressReserve, cuMemAddressReserve, 0)                     \
    X(cuMemAddressFree, cuMemAddressFree, 0)                           \
    X(cuMemMap, cuMemMap, 0)                                           \
    X(cuMemUnmap, cuMemUnmap, 0)                                       \
    X(cuMemSetAccess, cuMemSetAccess, 0)                               \
    X(cuArrayCreate_v2, cuArrayCreate, 0)                              \
    X(cuArrayDestroy, cuArrayDestroy, 0)                               \
    X(cuModuleLoadData, cuModuleLoadData, 0)                           \
    X(cuModuleGetFunction, cuModuleGetFunction, 0)                     \
    X(cuModuleUnload, cuModuleUnload, 0)                               \
    X(cuStreamCreate, cuStreamCreate, 0)                               \
    X(cuStreamDestroy_v2, cuStreamDestroy, 0)                          \
    X(cuStreamSynchronize, cuStreamSynchronize, 1)                     \
    X(cuStreamQuery, cuStreamQuery, 1)                                 \
    X(cuEventCreate, cuEventCreate, 0)                                 \
    X(cuEventRecord, cuEventRecord, 1)                                 \
    X(cuEventSynchronize, cuEventSynchronize, 0)                       \
    X(cuEventElapsedTime, cuEventElapsedTime, 0)                       \
    X(cuEventDestroy_v2, cuEventDestroy, 0)                            \
    X(cuLaunchKernel, cuLaunchKernel, 1)                               \
    X(cuLaunchKernelEx, cuLaunchKernelEx, 1)                           \
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 1)         \
    X(cuFuncSetBlockShape, cuFuncSetBlockShape, 0)                     \
    X(cuParamSetSize, cuParamSetSize, 0)                               \
    X(cuParamSetv, cuParamSetv, 0)                                     \
    X(cuLaunch, cuLaunch, 0)                                           \
    X(cuLaunchGrid, cuLaunchGrid, 0)                                   \
    X(cuLaunchGridAsync, cuLaunchGridAsync, 0)                         \
    X(cuLaunchCooperativeKernelMultiDevice, cuLaunchCooperativeKernelMultiDevice, 0) \
    X(cuGraphCreate, cuGraphCreate, 0)                                 \
    X(cuGraphAddKernelNode_v2, cuGraphAddKernelNode, 0)                \
    X(cuGraphInstantiateWithFlags, cuGraphInstantiate, 0)              \
    X(cuGraphLaunch, cuGraphLaunch, 1)                                 \
    X(cuGraphExecDestroy, cuGraphExecDestroy, 0)                       \
    X(cuGraphDestroy, cuGraphDestroy, 0)

struct api {
#define X(sym, base, ptsz) __typeof__(&sym) sym;
    BURN_FUNCTIONS(X)
#undef X
};


enum alloc_api { AA_ALLOC, AA_PITCH, AA_MANAGED, AA_ASYNC, AA_POOL, AA_VMM, AA_ARRAY };
static const char *const alloc_apis[] = {"alloc", "pitch", "managed", "async",
                                         "pool",  "vmm",   "array",   NULL};
enum launch_api { LA_KERNEL, LA_EX, LA_COOP, LA_GRAPH, LA_LAUNCH, LA_GRID, LA_GRID_ASYNC, LA_MULTI };
static const char *const launch_apis[] = {"kernel", "ex", "cooperative", "graph",
                                          "launch", "grid", "grid-async", "multi-device", NULL};
static const char *const launch_calls[] = {"cuLaunchKernel", "cuLaunchKernelEx",
                                           "cuLaunchCooperativeKernel", "cuGraphLaunch",
                                           "cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync",
                                           "cuLaunchCooperativeKernelMultiDevice"};
enum resolver { RESOLVE_PROC, RESOLVE_DLSYM };
/* How a burst's end is waited for (--burst-sync): the shapes applications use. */
enum burst_sync { BS_CTX, BS_STREAMS, BS_EVENTS, BS_QUERY, BS_NONE };
static const char *const burst_syncs[] = {"ctx", "streams", "events", "query", "none", NULL};
static const char *const resolvers[] = {"proc", "dlsym", NULL};

struct options {
    uint64_t device, kernel_ns, launches, streams, sync_every, graph_nodes;
    size_t sizes[MAX_ALLOCS], nsizes, until_fail_chunk;
    double hold_s, duration_s, duty, burst_ms, gap_ms;
    int alloc_api, launch_api, resolve, burst_sync;
    bool require_alloc, events, per_thread, launches_given;
};

/* The steps of a VMM allocation that succeeded, to undo when freeing. */
enum { HELD_HANDLE = 1, HELD_VA = 2, HELD_MAP = 4 };

struct alloc {
    CUdeviceptr ptr;
    size_t bytes; /* what the driver granted, not what was asked */
    CUmemGenericAllocationHandle handle;
    CUarray array;
    unsigned held;
};

struct burn {
    struct options opt;
    void *dl;
    struct api f;
    CUdevice dev;
    CUcontext ctx;
    char name[256], uuid[48];
    size_t total_mem, mem_free_before, mem_total_reported, mem_free_after_alloc;
    CUmemoryPool pool;
    struct alloc *allocs;
    size_t nallocs, cap_allocs, granted, uf_count, uf_bytes;
    CUresult results[MAX_ALLOCS], uf_result;
    bool alloc_failed, timed;
    CUmodule mod;
    CUfunction fn;
    CUgraph graph;
    CUgraphExec exec;
    CUstream streams[MAX_STREAMS];
    CUevent ev[2][MAX_STREAMS]; /* start and end, per stream */
    CUevent burst_ev[MAX_STREAMS]; /* --burst-sync events: each stream's end of burst */
    float ev_ms[MAX_STREAMS];
    uint64_t launched, bursts;
    double t0, busy_s, wall_s, max_launch_s;
    const char *error_calls[MAX_ERRORS];
    CUresult error_results[MAX_ERRORS];
    size_t nerrors;
};

/* ---- helpers ------------------------------------------------------------ */

/* Records a failure of the run (not of setup); true if r is success. */
static bool check(struct burn *b, const char *call, CUresult r)
{
    if (r != CUDA_SUCCESS && b->nerrors < MAX_ERRORS) {
        b->error_calls[b->nerrors] = call;
        b->error_results[b->nerrors++] = r;
    }
    return r == CUDA_SUCCESS;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Until a time on now_s()'s clock, clamped so that the conversion to time_t
 * stays defined for any duty. */
static void sleep_until(double t)
{
    t = t < 1e12 ? t : 1e12;
    struct timespec ts = {.tv_sec = (time_t)t};
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* ---- arguments: one table gives the options, their checks and --help ---- */

/* K_REAL takes [min, max], K_POSITIVE (0, max]: bounds that keep every later
 * conversion defined. */
enum kind { K_FLAG, K_COUNT, K_SIZE, K_SIZES, K_REAL, K_POSITIVE, K_CHOICE, K_HELP };

struct spec {
    const char *name, *arg;
    enum kind kind;
    size_t off; /* of the field in struct options */
    double min, max;
    const char *const *choices;
    const char *help;
};

#define OPT(name, arg, kind, field, min, max, help) \
    {name, arg, kind, offsetof(struct options, field), min, max, NULL, help}
#define CHOICE(name, arg, field, choices, help) \
    {name, arg, K_CHOICE, offsetof(struct options, field), 0, 0, choices, help}
static const struct spec specs[] = {
    OPT("device", "N", K_COUNT, device, 0, INT_MAX, "device ordinal (0)"),
    OPT("alloc", "SIZE", K_SIZES, sizes, 0, 0, "allocate SIZE: 1000000, 512MiB, 4G (repeatable)"),
    CHOICE("alloc-api", "API", alloc_api, alloc_apis, "alloc|pitch|managed|async|pool|vmm|array"),
    OPT("alloc-until-fail", "CHUNK", K_SIZE, until_fail_chunk, 0, 0,
        "allocate CHUNK after CHUNK until the driver refuses"),
    OPT("hold", "SECONDS", K_REAL, hold_s, 0, 1e9, "keep the allocations this long (0)"),
    OPT("require-alloc", NULL, K_FLAG, require_alloc, 0, 0, "exit 3 if an allocation fails"),
    OPT("kernel-ns", "NS", K_COUNT, kernel_ns, 0, 1e15, "device time of one kernel (1000000)"),
    OPT("launches", "K", K_COUNT, launches, 0, 1e15, "launch K kernels (0)"),
    OPT("duration", "SEC", K_POSITIVE, duration_s, 0, 1e9, "or launch kernels for SEC seconds"),
    OPT("streams", "S", K_COUNT, streams, 1, MAX_STREAMS, "round-robin over S streams (1)"),
    OPT("duty", "F", K_POSITIVE, duty, 0, 1, "sleep after each kernel: busy/total = F (1)"),
    OPT("sync-every", "N", K_COUNT, sync_every, 1, 1e15,
        "with duty 1, sync every N launch calls (at the end; ~50 ms with --duration)"),
    OPT("burst-ms", "MS", K_POSITIVE, burst_ms, 0, 1e9,
        "with --duration: queue MS of kernels, cuCtxSynchronize, sleep --gap-ms, repeat"),
    OPT("gap-ms", "MS", K_REAL, gap_ms, 0, 1e9, "idle time after each burst (0)"),
    CHOICE("burst-sync", "HOW", burst_sync, burst_syncs,
           "end a burst with cuCtxSynchronize (ctx), cuStreamSynchronize per stream (streams), an event per "
           "stream and cuEventSynchronize (events), cuStreamQuery polling (query), or nothing (none)"),
    CHOICE("launch-api", "API", launch_api, launch_apis,
           "kernel|ex|cooperative|graph|launch|grid|grid-async|multi-device (the last four: deprecated)"),
    OPT("graph-nodes", "N", K_COUNT, graph_nodes, 1, 1024, "kernels per graph, each a launch (4)"),
    OPT("events", NULL, K_FLAG, events, 0, 0, "time each stream with CUDA events"),
    OPT("per-thread-stream", NULL, K_FLAG, per_thread, 0, 0, "use the per-thread default stream"),
    CHOICE("resolve", "HOW", resolve, resolvers, "proc (cuGetProcAddress) or dlsym"),
    {"help", NULL, K_HELP, 0, 0, 0, NULL, "print this help"},
};
#define NSPECS (sizeof specs / sizeof specs[0])

static int print_usage(void)
{
    printf("usage: cgpu-burn [options]\nAllocate GPU memory and run timed kernels through the "
           "CUDA driver API;\nprint one JSON object describing what happened.\n\n");
    for (size_t i = 0; i < NSPECS; i++) {
        int w = printf("  --%s %s", specs[i].name, specs[i].arg ? specs[i].arg : "");
        printf("%*s%s\n", w < 28 ? 28 - w : 1, "", specs[i].help);
    }
    return 0;
}

static bool parse_u64(const char *s, uint64_t *out, char **end)
{
    if (*s < '0' || *s > '9')
        return false; /* strtoull would take signs and spaces */
    errno = 0;
    *out = strtoull(s, end, 10);
    return errno != ERANGE;
}

/* Binary multiples, written 4G or 4GiB, as nvidia-smi counts. */
static bool parse_size(const char *s, size_t *out)
{
    static const char units[] = "KMGT";
    uint64_t v;
    char *end;
    if (!parse_u64(s, &v, &end) || v == 0)
        return false;
    const char *unit = *end ? strchr(units, *end) : NULL;
    unsigned shift = unit ? 10 * (unsigned)(unit - units + 1) : 0;
    if ((*end && (!unit || (end[1] && strcmp(end + 1, "iB") != 0))) || v > SIZE_MAX >> shift)
        return false;
    *out = (size_t)(v << shift);
    return true;
}

static bool apply(struct options *o, const struct spec *sp, const char *arg)
{
    void *field = (char *)o + sp->off;
    char *end;
    uint64_t u;
    double d;
    switch (sp->kind) {
    case K_FLAG: return *(bool *)field = true;
    case K_SIZE: return parse_size(arg, field);
    case K_SIZES: return parse_size(arg, &o->sizes[o->nsizes++]);
    case K_COUNT:
        if (!parse_u64(arg, &u, &end) || *end || (double)u < sp->min || (double)u > sp->max)
            return false;
        return *(uint64_t *)field = u, true;
    case K_REAL:
    case K_POSITIVE:
        errno = 0;
        d = strtod(arg, &end);
        if (end == arg || *end || errno || !isfinite(d) || d < sp->min || d > sp->max)
            return false;
        return *(double *)field = d, sp->kind == K_REAL || d > 0;
    case K_CHOICE:
        for (int i = 0; sp->choices[i]; i++)
            if (strcmp(arg, sp->choices[i]) == 0)
                return *(int *)field = i, true;
        return false;
    case K_HELP: break;
    }
    return false;
}

/* Returns -1 to go on, or the exit code. */
static int parse_options(int argc, char **argv, struct options *o)
{
    struct option longopts[NSPECS + 1] = {{0}};
    for (size_t i = 0; i < NSPECS; i++)
        longopts[i] = (struct option){specs[i].name, specs[i].arg ? required_argument : no_argument,
                                      NULL, 0x100 + (int)i};
    *o = (struct options){.kernel_ns = 1000000, .streams = 1, .duty = 1, .graph_nodes = 4};
    opterr = 0;
    for (int c; (c = getopt_long(argc, argv, "+:", longopts, NULL)) != -1;) {
        const struct spec *sp = c >= 0x100 ? &specs[c - 0x100] : NULL;
        if (c == ':')
            return fail("option %s needs a value (see --help)", argv[optind - 1]);
        if (!sp)
            return fail("unknown option or unexpected value: %s (see --help)", argv[optind - 1]);
        if (sp->kind == K_HELP)
            return print_usage();
        if (sp->kind == K_SIZES && o->nsizes == MAX_ALLOCS)
            return fail("at most %d --alloc options", MAX_ALLOCS);
        if (!apply(o, sp, optarg))
            return fail("invalid value '%s' for --%s %s: %s", optarg, sp->name, sp->arg, sp->help);
        o->launches_given |= sp->off == offsetof(struct options, launches);
    }
    if (optind < argc)
        return fail("unexpected argument '%s' (see --help)", argv[optind]);
    if (o->launches_given && o->duration_s > 0)
        return fail("--launches and --duration cannot be used together");
    if (o->burst_ms > 0 && o->duration_s <= 0)
        return fail("--burst-ms needs --duration");
    if (o->burst_ms > 0 && (o->duty < 1 || o->sync_every))
        return fail("--burst-ms cannot be used with --duty or --sync-every");
    if (o->burst_sync != BS_CTX && o->burst_ms <= 0)
        return fail("--burst-sync needs --burst-ms");
    if (o->burst_sync != BS_CTX && (o->launch_api == LA_LAUNCH || o->launch_api == LA_GRID))
        return fail("--burst-sync other than ctx needs a launch API that takes a stream");
    if (o->gap_ms > 0 && o->burst_ms <= 0)
        return fail("--gap-ms needs --burst-ms");
    return -1;
}

/* ---- driver ------------------------------------------------------------- */

static void *lookup(const struct burn *b, __typeof__(&cuGetProcAddress_v2) get_proc,
                    const char *sym, const char *base, bool has_ptsz)
{
    void *pfn = NULL;
    if (b->opt.resolve == RESOLVE_DLSYM) {
        char name[96];
        snprintf(name, sizeof name, "%s%s", sym, has_ptsz && b->opt.per_thread ? "_ptsz" : "");
        if (!(pfn = dlsym(b->dl, name)))
            fail("cannot resolve %s in libcuda.so.1: %s", name, dlerror());
        return pfn;
    }
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = get_proc(base, &pfn, BURN_CUDA_VERSION,
                          b->opt.per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                            : CU_GET_PROC_ADDRESS_DEFAULT,
                          &status);
    if (r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && pfn)
        return pfn;
    fail("cannot resolve %s with cuGetProcAddress (CUDA %d): result %d, %s", base,
         BURN_CUDA_VERSION, (int)r,
         status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT ? "version not sufficient"
                                                               : "symbol not found");
    return NULL;
}

static int load_driver(struct burn *b)
{
    __typeof__(&cuGetProcAddress_v2) get_proc = NULL;
    void *pfn;
    int rc = open_driver(&b->dl, &get_proc);
    if (rc)
        return rc;
#define X(sym, base, ptsz)                                   \
    if (!(pfn = lookup(b, get_proc, #sym, #base, ptsz)))     \
        return 2;                                            \
    memcpy(&b->f.sym, &pfn, sizeof pfn);
    BURN_FUNCTIONS(X)
#undef X
    return 0;
}

/* The context the CUDA runtime would use: the device's primary context. */
static int open_device(struct burn *b)
{
    const struct api *f = &b->f;
    CUuuid id;
    SETUP(b, "cuInit", f->cuInit(0));
    SETUP(b, "cuDeviceGet", f->cuDeviceGet(&b->dev, (int)b->opt.device));
    SETUP(b, "cuDevicePrimaryCtxRetain", f->cuDevicePrimaryCtxRetain(&b->ctx, b->dev));
    SETUP(b, "cuCtxSetCurrent", f->cuCtxSetCurrent(b->ctx));
    SETUP(b, "cuDeviceGetName", f->cuDeviceGetName(b->name, (int)sizeof b->name, b->dev));
    SETUP(b, "cuDeviceGetUuid", f->cuDeviceGetUuid_v2(&id, b->dev));
    SETUP(b, "cuDeviceTotalMem", f->cuDeviceTotalMem_v2(&b->total_mem, b->dev));
    SETUP(b, "cuMemGetInfo", f->cuMemGetInfo_v2(&b->mem_free_before, &b->mem_total_reported));
    const unsigned char *x = (const unsigned char *)id.bytes;
    snprintf(b->uuid, sizeof b->uuid,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", x[0],
             x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12], x[13],
             x[14], x[15]);
    return 0;
}

/* ---- allocation --------------------------------------------------------- */

/* Stream-ordered allocations only exist once the stream gets there. */
static CUresult synced(const struct api *f, CUresult r)
{
    return r == CUDA_SUCCESS ? f->cuStreamSynchronize(NULL) : r;
}

/* 1024 rows of SIZE/1024 bytes: a shape any GPU takes up to terabytes. */
static CUresult alloc_pitch(const struct api *f, size_t size, struct alloc *a)
{
    size_t height = size >= 1024 ? 1024 : 1, width = (size + height - 1) / height, pitch = 0;
    CUresult r = f->cuMemAllocPitch_v2(&a->ptr, &pitch, width, height, 4);
    a->bytes = pitch * height;
    return r;
}

/* Texels of 16 bytes (4 floats) in rows of 16384: 2D CUDA arrays reach
 * 131072 x 65536 texels on sm_70 and later, so one array can hold 16 GiB. */
static CUresult alloc_array(const struct api *f, size_t size, struct alloc *a)
{
    size_t texels = size / 16 + (size % 16 != 0);
    size_t width = texels < 16384 ? texels : 16384, height = (texels + width - 1) / width;
    CUDA_ARRAY_DESCRIPTOR d = {
        .Width = width, .Height = height, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    a->bytes = width * height * 16;
    return f->cuArrayCreate_v2(&a->array, &d);
}

static CUresult alloc_vmm(const struct burn *b, size_t size, struct alloc *a)
{
    const struct api *f = &b->f;
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = b->dev}};
    CUmemAccessDesc rw = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    size_t gran = 0;
    CUresult r = f->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS || gran == 0 || size > SIZE_MAX - gran)
        return r != CUDA_SUCCESS ? r : CUDA_ERROR_INVALID_VALUE;
    a->bytes = (size + gran - 1) / gran * gran;
    if ((r = f->cuMemCreate(&a->handle, a->bytes, &prop, 0)) != CUDA_SUCCESS)
        return r;
    a->held = HELD_HANDLE;
    if ((r = f->cuMemAddressReserve(&a->ptr, a->bytes, 0, 0, 0)) != CUDA_SUCCESS)
        return r;
    a->held |= HELD_VA;
    if ((r = f->cuMemMap(a->ptr, a->bytes, 0, a->handle, 0)) != CUDA_SUCCESS)
        return r;
    a->held |= HELD_MAP;
    return f->cuMemSetAccess(a->ptr, a->bytes, &rw, 1);
}

static CUresult alloc_one(const struct burn *b, size_t size, struct alloc *a)
{
    const struct api *f = &b->f;
    *a = (struct alloc){.bytes = size};
    switch ((enum alloc_api)b->opt.alloc_api) {
    case AA_ALLOC: return f->cuMemAlloc_v2(&a->ptr, size);
    case AA_PITCH: return alloc_pitch(f, size, a);
    case AA_MANAGED: return f->cuMemAllocManaged(&a->ptr, size, CU_MEM_ATTACH_GLOBAL);
    case AA_ASYNC: return synced(f, f->cuMemAllocAsync(&a->ptr, size, NULL));
    case AA_POOL: return synced(f, f->cuMemAllocFromPoolAsync(&a->ptr, size, b->pool, NULL));
    case AA_VMM: return alloc_vmm(b, size, a);
    case AA_ARRAY: return alloc_array(f, size, a);
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* Keeps whatever the driver handed out, even in a failed attempt, so that all
 * of it is freed. Returns the attempt's result; *granted is 0 on failure. */
static CUresult alloc_keep(struct burn *b, size_t size, size_t *granted)
{
    *granted = 0;
    if (b->nallocs == b->cap_allocs) {
        size_t cap = b->cap_allocs ? 2 * b->cap_allocs : 16;
        struct alloc *p = realloc(b->allocs, cap * sizeof *p);
        if (!p)
            return CUDA_ERROR_OUT_OF_MEMORY; /* of host memory, but just as final */
        b->allocs = p;
        b->cap_allocs = cap;
    }
    struct alloc *a = &b->allocs[b->nallocs];
    CUresult r = alloc_one(b, size, a);
    b->nallocs += a->ptr || a->array || a->held;
    *granted = r == CUDA_SUCCESS ? a->bytes : 0;
    return r;
}

/* Managed memory can oversubscribe a real GPU without ever failing, so the
 * search also stops, with CUDA_SUCCESS, at twice the device's memory. */
static void alloc_until_fail(struct burn *b)
{
    size_t got;
    while ((b->uf_result = alloc_keep(b, b->opt.until_fail_chunk, &got)) == CUDA_SUCCESS) {
        b->uf_count++;
        b->uf_bytes += got;
        if (b->uf_bytes / 2 >= b->total_mem)
            break;
    }
    b->alloc_failed |= b->uf_count == 0 || (b->uf_result != CUDA_SUCCESS &&
                                            b->uf_result != CUDA_ERROR_OUT_OF_MEMORY);
}

static int allocate(struct burn *b)
{
    const struct options *o = &b->opt;
    size_t got, total;
    if (o->alloc_api == AA_POOL && (o->nsizes || o->until_fail_chunk)) {
        CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = b->dev}};
        SETUP(b, "cuMemPoolCreate", b->f.cuMemPoolCreate(&b->pool, &props));
    }
    for (size_t i = 0; i < o->nsizes; i++) {
        b->results[i] = alloc_keep(b, o->sizes[i], &got);
        b->granted += got;
        b->alloc_failed |= b->results[i] != CUDA_SUCCESS;
    }
    if (o->until_fail_chunk)
        alloc_until_fail(b);
    SETUP(b, "cuMemGetInfo", b->f.cuMemGetInfo_v2(&b->mem_free_after_alloc, &total));
    return 0;
}

static void free_one(struct burn *b, const struct alloc *a)
{
    const struct api *f = &b->f;
    switch ((enum alloc_api)b->opt.alloc_api) {
    case AA_ASYNC:
    case AA_POOL: check(b, "cuMemFreeAsync", f->cuMemFreeAsync(a->ptr, NULL)); break;
    case AA_ARRAY: check(b, "cuArrayDestroy", f->cuArrayDestroy(a->array)); break;
    case AA_VMM:
        if (a->held & HELD_MAP)
            check(b, "cuMemUnmap", f->cuMemUnmap(a->ptr, a->bytes));
        if (a->held & HELD_VA)
            check(b, "cuMemAddressFree", f->cuMemAddressFree(a->ptr, a->bytes));
        if (a->held & HELD_HANDLE)
            check(b, "cuMemRelease", f->cuMemRelease(a->handle));
        break;
    default: check(b, "cuMemFree", f->cuMemFree_v2(a->ptr));
    }
}

static void free_allocs(struct burn *b)
{
    bool ordered = b->opt.alloc_api == AA_ASYNC || b->opt.alloc_api == AA_POOL;
    for (size_t i = 0; i < b->nallocs; i++)
        free_one(b, &b->allocs[i]);
    if (ordered && b->nallocs)
        check(b, "cuStreamSynchronize", b->f.cuStreamSynchronize(NULL));
    if (b->pool)
        check(b, "cuMemPoolDestroy", b->f.cuMemPoolDestroy(b->pool));
    b->nallocs = 0;
    b->pool = NULL;
}

/* ---- kernels ------------------------------------------------------------ */

static CUresult build_graph(struct burn *b)
{
    const struct api *f = &b->f;
    void *params[] = {&b->opt.kernel_ns};
    CUDA_KERNEL_NODE_PARAMS_v2 np = {.func = b->fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
                                     .blockDimX = 1, .blockDimY = 1, .blockDimZ = 1,
                                     .kernelParams = params};
    CUgraphNode prev = NULL, node = NULL;
    CUresult r = f->cuGraphCreate(&b->graph, 0);
    for (uint64_t i = 0; r == CUDA_SUCCESS && i < b->opt.graph_nodes; i++) {
        r = f->cuGraphAddKernelNode_v2(&node, b->graph, prev ? &prev : NULL, prev ? 1 : 0, &np);
        prev = node;
    }
    return r == CUDA_SUCCESS ? f->cuGraphInstantiateWithFlags(&b->exec, b->graph, 0) : r;
}

/* Done before allocating: on a real GPU the module, streams and events take
 * device memory too, which --alloc-until-fail would otherwise have used up. */
static int setup_kernel(struct burn *b)
{
    const struct api *f = &b->f;
    SETUP(b, "cuModuleLoadData", f->cuModuleLoadData(&b->mod, cgpu_spin_ptx));
    SETUP(b, "cuModuleGetFunction", f->cuModuleGetFunction(&b->fn, b->mod, CGPU_SPIN_ENTRY));
    for (uint64_t i = 0; i < b->opt.streams; i++) {
        SETUP(b, "cuStreamCreate", f->cuStreamCreate(&b->streams[i], CU_STREAM_DEFAULT));
        for (int k = 0; k < 2 && b->opt.events; k++)
            SETUP(b, "cuEventCreate", f->cuEventCreate(&b->ev[k][i], CU_EVENT_DEFAULT));
        if (b->opt.burst_ms > 0 && b->opt.burst_sync == BS_EVENTS)
            SETUP(b, "cuEventCreate", f->cuEventCreate(&b->burst_ev[i], CU_EVENT_DISABLE_TIMING));
    }
    if (b->opt.launch_api == LA_GRAPH)
        SETUP(b, "building the CUDA graph", build_graph(b));
    if (b->opt.launch_api >= LA_LAUNCH && b->opt.launch_api <= LA_GRID_ASYNC) {
        /* the deprecated API: shape and parameters live on the function */
        SETUP(b, "cuFuncSetBlockShape", f->cuFuncSetBlockShape(b->fn, 1, 1, 1));
        SETUP(b, "cuParamSetv", f->cuParamSetv(b->fn, 0, &b->opt.kernel_ns, sizeof(b->opt.kernel_ns)));
        SETUP(b, "cuParamSetSize", f->cuParamSetSize(b->fn, sizeof(b->opt.kernel_ns)));
    }
    return 0;
}

static CUresult launch_one(struct burn *b, CUstream s)
{
    const struct api *f = &b->f;
    void *params[] = {&b->opt.kernel_ns};
    CUlaunchConfig cfg = {.gridDimX = 1, .gridDimY = 1, .gridDimZ = 1,
                          .blockDimX = 1, .blockDimY = 1, .blockDimZ = 1, .hStream = s};
    switch ((enum launch_api)b->opt.launch_api) {
    case LA_KERNEL: return f->cuLaunchKernel(b->fn, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
    case LA_EX: return f->cuLaunchKernelEx(&cfg, b->fn, params, NULL);
    case LA_COOP: return f->cuLaunchCooperativeKernel(b->fn, 1, 1, 1, 1, 1, 1, 0, s, params);
    case LA_GRAPH: return f->cuGraphLaunch(b->exec, s);
    case LA_LAUNCH: return f->cuLaunch(b->fn);
    case LA_GRID: return f->cuLaunchGrid(b->fn, 1, 1);
    case LA_GRID_ASYNC: return f->cuLaunchGridAsync(b->fn, 1, 1, s);
    case LA_MULTI: {
        CUDA_LAUNCH_PARAMS one = {.function = b->fn, .gridDimX = 1, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 1,
                                  .blockDimY = 1, .blockDimZ = 1, .hStream = s, .kernelParams = params};
        return f->cuLaunchCooperativeKernelMultiDevice(&one, 1, 0);
    }
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* cuLaunch and cuLaunchGrid take no stream: they run on the NULL stream. */
static bool on_null_stream(const struct burn *b)
{
    return b->opt.launch_api == LA_LAUNCH || b->opt.launch_api == LA_GRID;
}

static bool sync_streams(struct burn *b)
{
    for (uint64_t i = 0; i < b->opt.streams; i++)
        if (!check(b, "cuStreamSynchronize", b->f.cuStreamSynchronize(b->streams[i])))
            return false;
    return !on_null_stream(b) || check(b, "cuStreamSynchronize", b->f.cuStreamSynchronize(CU_STREAM_LEGACY));
}

/* Records event `which` (0 start, 1 end) on every stream. */
static bool record_events(struct burn *b, int which)
{
    for (uint64_t i = 0; b->opt.events && i < b->opt.streams; i++)
        if (!check(b, "cuEventRecord", b->f.cuEventRecord(b->ev[which][i], b->streams[i])))
            return false;
    return true;
}

static bool read_events(struct burn *b)
{
    const struct api *f = &b->f;
    for (uint64_t i = 0; i < b->opt.streams; i++)
        if (!check(b, "cuEventSynchronize", f->cuEventSynchronize(b->ev[1][i])) ||
            !check(b, "cuEventElapsedTime",
                   f->cuEventElapsedTime(&b->ev_ms[i], b->ev[0][i], b->ev[1][i])))
            return false;
    return true;
}

static bool launch_and_pace(struct burn *b, uint64_t call, uint64_t sync_every)
{
    const struct options *o = &b->opt;
    CUstream s = b->streams[call % o->streams];
    double start = now_s();
    if (!check(b, launch_calls[o->launch_api], launch_one(b, s)))
        return false;
    double took = now_s() - start; /* a launch held at a gate: how long at most */
    if (took > b->max_launch_s)
        b->max_launch_s = took;
    b->launched += o->launch_api == LA_GRAPH ? o->graph_nodes : 1;
    if (o->duty < 1) {
        if (!check(b, "cuStreamSynchronize", b->f.cuStreamSynchronize(on_null_stream(b) ? CU_STREAM_LEGACY : s)))
            return false;
        /* Paced on the totals, so one late wake-up is made up by the next. */
        b->busy_s += now_s() - start;
        sleep_until(b->t0 + b->busy_s / o->duty);
        return true;
    }
    return !sync_every || (call + 1) % sync_every || sync_streams(b);
}

/* With a duration and no pacing, asynchronous launches would queue far past
 * the deadline. Syncing after about 50 ms of device work keeps the overshoot
 * small, and the device idle for one wake-up per sync, not one per kernel. */
static uint64_t sync_interval(const struct options *o)
{
    uint64_t per_call = o->kernel_ns * (o->launch_api == LA_GRAPH ? o->graph_nodes : 1);
    if (o->sync_every || o->duration_s <= 0)
        return o->sync_every;
    uint64_t n = per_call ? 50000000 / per_call : 1024;
    return n < o->streams ? o->streams : n > 1024 ? 1024 : n;
}

/* Waits for a burst as --burst-sync says. Query polling looks every 50 us
 * (a server's poll loop); `none` does not wait: the work runs while the
 * program sleeps its gap. */
static bool end_burst(struct burn *b)
{
    const struct api *f = &b->f;
    const struct options *o = &b->opt;
    switch ((enum burst_sync)o->burst_sync) {
    case BS_CTX: return check(b, "cuCtxSynchronize", f->cuCtxSynchronize());
    case BS_STREAMS: return sync_streams(b);
    case BS_EVENTS:
        for (uint64_t i = 0; i < o->streams; i++)
            if (!check(b, "cuEventRecord", f->cuEventRecord(b->burst_ev[i], b->streams[i])))
                return false;
        for (uint64_t i = 0; i < o->streams; i++)
            if (!check(b, "cuEventSynchronize", f->cuEventSynchronize(b->burst_ev[i])))
                return false;
        return true;
    case BS_QUERY:
        for (uint64_t i = 0; i < o->streams; i++) {
            CUresult r;
            while ((r = f->cuStreamQuery(b->streams[i])) == CUDA_ERROR_NOT_READY)
                sleep_until(now_s() + 50e-6);
            if (!check(b, "cuStreamQuery", r))
                return false;
        }
        return true;
    case BS_NONE: return true;
    }
    return false;
}

/* An inference server's pattern: a burst of queued work, a wait for all of
 * it (--burst-sync), then idle. */
static bool run_bursts(struct burn *b)
{
    const struct options *o = &b->opt;
    uint64_t per_call = o->kernel_ns * (o->launch_api == LA_GRAPH ? o->graph_nodes : 1);
    double want = o->burst_ms * 1e6 / (per_call ? (double)per_call : 1.0);
    uint64_t calls = want < 1 ? 1 : want > 1e9 ? 1000000000 : (uint64_t)want;
    calls += (double)calls < want; /* rounded up, without libm */
    double end = b->t0 + o->duration_s;
    bool ok = true;
    for (uint64_t call = 0; ok && now_s() < end;) {
        for (uint64_t i = 0; ok && i < calls; i++)
            ok = launch_and_pace(b, call++, 0);
        ok = ok && end_burst(b);
        b->bursts += ok;
        double wake = now_s() + o->gap_ms * 1e-3;
        sleep_until(wake < end ? wake : end);
    }
    return ok;
}

static void run_launches(struct burn *b)
{
    const struct options *o = &b->opt;
    uint64_t sync_every = sync_interval(o);
    bool ok = record_events(b, 0);
    b->t0 = now_s();
    if (o->burst_ms > 0)
        ok = ok && run_bursts(b);
    for (uint64_t call = 0; ok && o->burst_ms <= 0; call++) {
        if (o->duration_s > 0 ? now_s() - b->t0 >= o->duration_s : b->launched >= o->launches)
            break;
        ok = launch_and_pace(b, call, sync_every);
    }
    ok = ok && record_events(b, 1);
    ok = sync_streams(b) && ok;
    b->wall_s = now_s() - b->t0;
    b->timed = ok && o->events && read_events(b);
}

/* Destroy errors are not reported: the workload has run by then. */
static void release_run(struct burn *b)
{
    const struct api *f = &b->f;
    if (b->exec)
        f->cuGraphExecDestroy(b->exec);
    if (b->graph)
        f->cuGraphDestroy(b->graph);
    for (size_t i = 0; i < MAX_STREAMS; i++) {
        for (int k = 0; k < 2; k++)
            if (b->ev[k][i])
                f->cuEventDestroy_v2(b->ev[k][i]);
        if (b->burst_ev[i])
            f->cuEventDestroy_v2(b->burst_ev[i]);
        if (b->streams[i])
            f->cuStreamDestroy_v2(b->streams[i]);
    }
    if (b->mod)
        f->cuModuleUnload(b->mod);
}

/* ---- report: one JSON object, written by hand ---------------------------- */

static void print_alloc(const struct burn *b)
{
    const struct options *o = &b->opt;
    printf("\"alloc\":{\"api\":\"%s\",\"requested\":[", alloc_apis[o->alloc_api]);
    for (size_t i = 0; i < o->nsizes; i++)
        printf("%s%zu", i ? "," : "", o->sizes[i]);
    printf("],\"results\":[");
    for (size_t i = 0; i < o->nsizes; i++)
        printf("%s\"%s\"", i ? "," : "", result_name(b->f.cuGetErrorName, b->results[i]));
    printf("],\"granted_bytes\":%zu,\"until_fail_chunk\":%zu,\"until_fail_count\":%zu,"
           "\"until_fail_bytes\":%zu,\"until_fail_result\":",
           b->granted, o->until_fail_chunk, b->uf_count, b->uf_bytes);
    if (o->until_fail_chunk)
        printf("\"%s\"},", result_name(b->f.cuGetErrorName, b->uf_result));
    else
        printf("null},");
}

/* event_ms is the slowest stream's: the device time the whole run took. */
static void print_timing(const struct burn *b)
{
    const struct options *o = &b->opt;
    float max_ms = 0;
    printf("\"max_launch_ms\":%.3f,", b->max_launch_s * 1e3);
    printf("\"launches\":%llu,\"kernel_ns\":%llu,\"wall_s\":%.6f,\"stream_event_ms\":",
           (unsigned long long)b->launched, (unsigned long long)o->kernel_ns, b->wall_s);
    if (!b->timed) {
        printf("null,\"event_ms\":null,");
        return;
    }
    for (uint64_t i = 0; i < o->streams; i++) {
        printf("%s%.4f", i ? "," : "[", (double)b->ev_ms[i]);
        max_ms = b->ev_ms[i] > max_ms ? b->ev_ms[i] : max_ms;
    }
    printf("],\"event_ms\":%.4f,", (double)max_ms);
}

/* mem_total_reported is cuMemGetInfo's total, total_mem cuDeviceTotalMem's:
 * under a memory limit the two may differ. */
static void print_report(const struct burn *b)
{
    const struct options *o = &b->opt;
    printf("{\"device\":%llu,\"name\":", (unsigned long long)o->device);
    json_str(b->name);
    printf(",\"uuid\":\"%s\",\"total_mem\":%zu,\"mem_free_before\":%zu,"
           "\"mem_total_reported\":%zu,\"mem_free_after_alloc\":%zu,",
           b->uuid, b->total_mem, b->mem_free_before, b->mem_total_reported,
           b->mem_free_after_alloc);
    print_alloc(b);
    print_timing(b);
    printf("\"burst_ms\":%.3f,\"gap_ms\":%.3f,\"bursts\":%llu,\"burst_sync\":\"%s\",", o->burst_ms, o->gap_ms,
           (unsigned long long)b->bursts, burst_syncs[o->burst_sync]);
    printf("\"launch_api\":\"%s\",\"graph_nodes\":%llu,\"streams\":%llu,\"duty\":%.4f,"
           "\"resolve\":\"%s\",\"per_thread_stream\":%s,\"errors\":[",
           launch_apis[o->launch_api], (unsigned long long)o->graph_nodes,
           (unsigned long long)o->streams, o->duty, resolvers[o->resolve],
           o->per_thread ? "true" : "false");
    for (size_t i = 0; i < b->nerrors; i++)
        printf("%s{\"call\":\"%s\",\"result\":\"%s\"}", i ? "," : "", b->error_calls[i],
               result_name(b->f.cuGetErrorName, b->error_results[i]));
    printf("]}\n");
}

/* ---- main --------------------------------------------------------------- */

static int run(struct burn *b)
{
    const struct options *o = &b->opt;
    bool launching = o->launches || o->duration_s > 0;
    int rc;
    if ((rc = load_driver(b)) || (rc = open_device(b)) || (launching && (rc = setup_kernel(b))) ||
        (rc = allocate(b)))
        return rc;
    if (launching)
        run_launches(b);
    sleep_until(now_s() + o->hold_s);
    free_allocs(b);
    print_report(b);
    if (fflush(stdout) != 0)
        return fail("cannot write the report: %s", strerror(errno));
    if (b->nerrors)
        return 1;
    return o->require_alloc && b->alloc_failed ? 3 : 0;
}

int main(int argc, char **argv)
{
    static struct burn b;
    int rc = parse_options(argc, argv, &b.opt);
    if (rc >= 0)
        return rc;
    rc = run(&b);
    release_run(&b);
    free_allocs(&b); /* a no-op unless setup failed after allocating */
    free(b.allocs);
    if (b.ctx)
        b.f.cuDevicePrimaryCtxRelease_v2(b.dev);
    if (b.dl)
        dlclose(b.dl);
    return rc;
}
