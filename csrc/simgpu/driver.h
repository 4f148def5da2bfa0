/* Internals of the simulated libcuda.so.1 shared by its source files.
 *
 * Ownership: one `sim_driver` per process (the driver's process state);
 * handles given to the application point at heap objects that the driver
 * owns until the matching destroy call. Thread-safety: `lock` guards the
 * process-local tables; shared GPU state is atomics (simstate.h). */
#ifndef CGPU_SIM_DRIVER_H
#define CGPU_SIM_DRIVER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "cgpu/cuda_abi.h"
#include "simstate.h"

#define SIM_EXPORT __attribute__((visibility("default")))

/* Handle magics catch stale and foreign handles instead of crashing. */
enum sim_magic {
    MAGIC_CTX = 0x43545831,
    MAGIC_STREAM = 0x53545231,
    MAGIC_EVENT = 0x45564e31,
    MAGIC_MODULE = 0x4d4f4431,
    MAGIC_FUNC = 0x46554e31,
    MAGIC_GRAPH = 0x47525031,
    MAGIC_GRAPH_EXEC = 0x47455831,
    MAGIC_POOL = 0x504f4f31,
    MAGIC_MEMHANDLE = 0x4d454d31,
    MAGIC_ARRAY = 0x41525231,
    MAGIC_DEAD = 0x44454144,
};

struct sim_stream {
    uint32_t magic;
    struct sim_ctx *ctx;
    _Atomic uint64_t tail;        /* ns when the stream's queued work ends */
    unsigned flags;
    int priority;
    uint64_t id;                  /* cuStreamGetId's, given on first ask; 0: none yet */
};

struct sim_ctx {
    uint32_t magic;
    int dev;                      /* simulated GPU, not the CUDA ordinal */
    unsigned flags;
    bool primary;
    _Atomic uint64_t last_end;    /* ns when all work of the context ends */
    uint64_t limit[3];            /* cuCtxSetLimit values by CUlimit; 0: the default */
    uint64_t limit_charged;       /* device bytes they hold beyond the defaults */
    CUfunc_cache cache_config;    /* cuCtxSetCacheConfig's preference */
    struct sim_stream legacy;     /* the NULL stream */
    uint64_t lost_count;          /* the GPU's loss count when the context was made */
    uint64_t id;                  /* cuCtxGetId's, given on first ask; 0: none yet */
};

struct sim_event {
    uint32_t magic;
    unsigned flags;
    _Atomic uint64_t when;        /* ns the recorded work completes */
    _Atomic bool recorded;
};

/* The deprecated launch API's per-function state (cuFuncSetBlockShape,
 * cuParamSet*); process-local, as unsynchronised as the real driver's. */
#define SIM_LEGACY_PARAM_MAX 4096
struct sim_legacy_launch {
    unsigned block[3];            /* 0 until cuFuncSetBlockShape */
    unsigned shared_bytes;
    unsigned param_size;
    _Alignas(8) unsigned char params[SIM_LEGACY_PARAM_MAX];
};

struct sim_function {
    uint32_t magic;
    struct sim_module *module;
    bool timed;                   /* spins on %globaltimer for param 0 ns */
    char name[120];
    struct sim_legacy_launch legacy;
    int attr[CU_FUNC_ATTRIBUTE_MAX];  /* cuFuncSetAttribute's values ... */
    uint32_t attr_set;            /* ... where bit i is set; else the default */
};

struct sim_module {
    uint32_t magic;
    int dev;
    int nfunc;
    struct sim_function *funcs;
};

/* A memory pool. The simulation keeps nothing reserved beyond what is
 * allocated (frees return memory at once), so reserved equals used. */
struct sim_pool {
    uint32_t magic;
    int dev;
    uint64_t used, used_high;     /* bytes allocated from it; under sim_drv.lock */
    uint64_t release_threshold;
    bool reuse_off[3];            /* CU_MEMPOOL_ATTR_REUSE_* set to 0 (default 1) */
};

/* ---- device memory (driver_alloc.c and the driver_*.c of each family) ---- */

#define SIM_VMM_GRANULARITY (2ULL << 20)

enum alloc_kind { ALLOC_MEMORY, ALLOC_RESERVED, ALLOC_MAPPED, ALLOC_IPC /* another process's, opened */ };

/* Physical memory of the virtual memory management API (driver_vmm.c). */
struct sim_memhandle {
    uint32_t magic;
    int dev;                      /* -1: host memory, charged to no GPU */
    uint64_t size;
    int mappings;
    int retains;                  /* references cuMemRetainAllocationHandle added */
    bool released;                /* every reference to the handle released */
    bool imported;                /* the memory is charged to the exporter */
    CUmemAllocationHandleType handle_types;
    void *bytes;                  /* backing of its contents, made on first copy */
};

/* One record of the process's allocation table: a device address range. */
struct alloc_entry {
    struct alloc_entry *next;
    CUdeviceptr ptr;
    uint64_t size;
    int dev;
    enum alloc_kind kind;
    struct sim_memhandle *handle; /* ALLOC_MAPPED */
    void *bytes;                  /* ALLOC_MEMORY: backing of its contents, made on first copy */
    uint64_t id;                  /* unique in the process (CU_POINTER_ATTRIBUTE_BUFFER_ID) */
    bool managed;                 /* cuMemAllocManaged */
    int fd;                       /* a memfd behind `bytes` once exported by cuIpcGetMemHandle; else -1 */
    struct sim_pool *pool;        /* the pool of a stream-ordered allocation */
};

/* Page-locked host memory as the driver hands it out or registers it. It is
 * host memory: nothing is charged to a GPU. The simulation does not lock the
 * pages (RLIMIT_MEMLOCK would fail large allocations a real driver makes). */
struct sim_host_mem {
    struct sim_host_mem *next;
    char *base;
    size_t size;
    unsigned flags;
    bool registered;              /* cuMemHostRegister: the application's memory */
    uint64_t id;                  /* CU_POINTER_ATTRIBUTE_BUFFER_ID */
};

struct sim_driver {
    pthread_mutex_t lock;
    _Atomic int initialized;
    struct sim_handle shared;
    struct sim_ctx primary[SIM_MAX_GPUS];
    int primary_refs[SIM_MAX_GPUS];
    struct sim_pool default_pool[SIM_MAX_GPUS];
    struct sim_pool *current_pool[SIM_MAX_GPUS]; /* cuDeviceSetMemPool's; NULL: the default */
    struct alloc_entry *allocs[4096]; /* driver_alloc.c: by device address */
    struct sim_host_mem *pinned;  /* driver_hostmem.c: page-locked host memory */
    uint64_t next_buffer_id;      /* CU_POINTER_ATTRIBUTE_BUFFER_ID of the last allocation */
    uint64_t next_object_id;      /* the last context or stream id given */
    uint64_t next_va[SIM_MAX_GPUS];
    uint64_t next_va_low;         /* below 4 GiB, for the 32-bit entry points */
    int visible[SIM_MAX_GPUS];    /* CUDA ordinal -> simulated GPU */
    int visible_count;
};

extern struct sim_driver sim_drv;

static inline const struct sim_config *sim_cfg(void)
{
    return &sim_drv.shared.st->config;
}

/* mps_client.c: at cuInit, become the client of the MPS server the control
 * daemon in CUDA_MPS_PIPE_DIRECTORY names (CUDA_SUCCESS and nothing done
 * when no daemon listens there); forget the connection in a forked child;
 * whether this process is a client; CUDA_ERROR_MPS_CLIENT_TERMINATED once
 * its server is gone. */
CUresult sim_mps_attach(void);
void sim_mps_forget(void);
bool sim_mps_client(void);
CUresult sim_mps_check(void);

/* CUDA_SUCCESS once cuInit succeeded, else CUDA_ERROR_NOT_INITIALIZED. */
CUresult sim_check_init(void);
/* Checks a CUDA ordinal and gives the simulated GPU behind it
 * (CUDA_VISIBLE_DEVICES maps one to the other). */
CUresult sim_device(CUdevice dev, int *phys);
CUdevice sim_ordinal(int phys);
/* The calling thread's current context, or NULL. */
struct sim_ctx *sim_current_ctx(void);
CUresult sim_require_ctx(struct sim_ctx **out);
/* sim_check_init, sim_device and sim_require_ctx, then the argument check
 * each entry point makes next: CUDA_ERROR_INVALID_VALUE when `bad_args`,
 * which is worked out before the call and so must not use what it gives. */
CUresult sim_check_init_args(bool bad_args);
CUresult sim_device_args(CUdevice dev, int *phys, bool bad_args);
CUresult sim_require_ctx_args(struct sim_ctx **out, bool bad_args);
/* sim_check_init, then h a live object of its kind: one whose first member
 * is `magic`; else `bad` (INVALID_HANDLE or INVALID_VALUE by kind). */
CUresult sim_check_handle(const void *h, uint32_t magic, CUresult bad);
/* Defines `static CUresult name(handle_t h, type **out)`: the init check and
 * handle lookup (sim_check_handle) that open the calls on one kind of object. */
#define SIM_HANDLE_GET(name, handle_t, type, magic_value, bad)                                     \
    static CUresult name(handle_t h, type **out)                                                   \
    {                                                                                              \
        _Static_assert(offsetof(type, magic) == 0, "sim_check_handle reads the magic first");      \
        *out = (type *)h;                                                                          \
        return sim_check_handle(*out, magic_value, bad);                                           \
    }

/* Validates a context handle the application passed. */
bool sim_ctx_valid(const struct sim_ctx *ctx);
void sim_ctx_note_end(struct sim_ctx *ctx, uint64_t end);

/* A fresh device address range for a graph allocation node on `dev`. */
CUdeviceptr sim_graph_va(int dev, uint64_t size);

/* Gives back the device memory a context's stack, heap and printf FIFO
 * settings hold, and forgets them (context destroyed or reset). */
void sim_ctx_drop_limits(struct sim_ctx *ctx);

/* Where GPU d's device addresses start: distinct, recognisable ranges. */
#define SIM_VA_BASE(d) (0x100000000000ULL * ((uint64_t)(d) + 1))

/* Least and greatest stream priority (CUDA: lower is more urgent). */
#define SIM_STREAM_PRIORITY_LEAST 0
#define SIM_STREAM_PRIORITY_GREATEST (-5)

/* Drop the allocation records a forked child inherited: the memory is the
 * parent's and stays charged to the parent's process slot. */
void sim_forget_allocations(void);

#define SIM_ALLOC_BUCKETS (sizeof(sim_drv.allocs) / sizeof(sim_drv.allocs[0]))

/* Host pages holding device memory's contents, mapped on first touch. */
void *sim_backing_map(uint64_t size);
void sim_backing_unmap(void *p, uint64_t size);
/* The allocation table; callers hold sim_drv.lock. */
CUdeviceptr sim_take_va(int dev, uint64_t size, uint64_t align);
void sim_table_link(struct alloc_entry *e);
CUresult sim_table_insert(CUdeviceptr ptr, uint64_t size, int dev, enum alloc_kind kind, struct sim_memhandle *handle);
struct alloc_entry *sim_table_remove(CUdeviceptr ptr, enum alloc_kind kind);
struct alloc_entry *sim_entry_at(CUdeviceptr p);
/* Charge and record, tag, and free a device allocation (lock not held);
 * ALLOC_IPC frees an opened one. */
CUresult sim_alloc_device(CUdeviceptr *dptr, uint64_t size, int dev);
void sim_tag_allocation(CUdeviceptr p, bool managed, struct sim_pool *pool);
CUresult sim_free_device(CUdeviceptr dptr, enum alloc_kind kind);
struct sim_pool *sim_current_pool(int dev);
/* The pinned host memory record holding p, or NULL; caller holds sim_drv.lock. */
struct sim_host_mem *sim_pinned_at(const void *p);
/* The stream a copy is ordered on; `sync`: wait for the work queued before. */
CUresult sim_copy_stream(CUstream h, bool per_thread, bool sync, struct sim_stream **out);

/* Resolve a stream argument, cuInit checked first: NULL, CU_STREAM_LEGACY
 * and CU_STREAM_PER_THREAD included; per_thread selects what NULL means
 * (_ptsz entry points). */
CUresult sim_resolve_stream(CUstream h, bool per_thread, struct sim_stream **out);
/* sim_resolve_stream, then CUDA_ERROR_INVALID_VALUE when `bad_args`. */
CUresult sim_resolve_stream_args(CUstream h, bool per_thread, struct sim_stream **out, bool bad_args);
/* Queue dur_ns of device work on a stream; returns when it is queued. */
void sim_stream_run(struct sim_stream *s, uint64_t dur_ns);

/* A host pointer as a unified address. */
#define SIM_HOST_ADDR(p) ((CUdeviceptr)(uintptr_t)(p))

/* The implementations driver_forwards.def's entry points call, by file;
 * per_thread: what a NULL stream means (the _ptds and _ptsz variants);
 * sync: the call waits as a synchronous one does. driver_core.c: */
CUresult sim_error_lookup(CUresult error, const char **pStr, bool name);
CUresult sim_lookup_proc(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status);
CUresult sim_ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult sim_stream_id(CUstream h, bool per_thread, unsigned long long *id);
/* driver_exec.c */
CUresult sim_stream_create(CUstream *phStream, unsigned int flags, int priority);
CUresult sim_stream_get(CUstream h, bool per_thread, int *priority, unsigned *flags);
CUresult sim_stream_sync(CUstream h, bool per_thread);
CUresult sim_stream_query(CUstream h, bool per_thread);
CUresult sim_stream_wait_event(CUstream h, CUevent ev, unsigned int flags, bool per_thread);
CUresult sim_stream_ctx(CUstream h, bool per_thread, CUcontext *pctx);
CUresult sim_event_record(CUevent ev, CUstream h, bool per_thread);
CUresult sim_launch_ex(const CUlaunchConfig *c, CUfunction f, void **params, void **extra, bool per_thread);
CUresult sim_launch_legacy(CUfunction f, int grid_width, int grid_height, CUstream h);
CUresult sim_graph_add_node(CUgraphNode *phNode, CUgraph hGraph, size_t numDependencies, const void *deps,
                            CUgraphNodeParams *params);
CUresult sim_graph_launch(CUgraphExec hGraphExec, CUstream h, bool per_thread);
/* capture.c */
CUresult sim_capture_begin(CUstream h, CUstreamCaptureMode mode, bool per_thread);
CUresult sim_capture_end(CUstream h, CUgraph *phGraph, bool per_thread);
CUresult sim_capture_is_active(CUstream h, bool per_thread, CUstreamCaptureStatus *status);
CUresult sim_capture_info(CUstream h, bool per_thread, CUstreamCaptureStatus *status, cuuint64_t *id, CUgraph *graph,
                          const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps);
/* the memory families */
CUresult sim_alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream hStream, bool per_thread);
CUresult sim_free_async(CUdeviceptr dptr, CUstream hStream, bool per_thread);
CUresult sim_pool_alloc(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream, bool per_thread);
CUresult sim_vmm_remove(CUdeviceptr ptr, size_t size, enum alloc_kind kind);
CUresult sim_array_destroy(void *handle);
CUresult sim_place_ok(CUdevice dev);
CUresult sim_location_ok(CUmemLocation loc);
CUresult sim_advise(CUdeviceptr p, size_t count, CUmem_advise advice, CUresult place);
CUresult sim_prefetch(CUdeviceptr p, size_t count, CUresult place, CUstream h, bool per_thread);
CUresult sim_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h, bool per_thread, bool sync);
CUresult sim_fill(CUdeviceptr dst, unsigned value, size_t elem, size_t count, CUstream h, bool per_thread, bool sync);
CUresult sim_fill_2d(CUdeviceptr dst, size_t pitch, unsigned value, size_t elem, size_t width, size_t height,
                     CUstream h, bool per_thread, bool sync);
CUresult sim_copy_2d(const CUDA_MEMCPY2D *c, CUstream h, bool per_thread, bool sync);
CUresult sim_copy_peer(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx, size_t n, CUstream h,
                       bool per_thread, bool sync);
CUresult sim_launch_host(CUstream h, bool per_thread, CUhostFn fn, void *data);
CUresult sim_add_callback(CUstream h, bool per_thread, CUstreamCallback cb, void *data, unsigned flags);

#endif
