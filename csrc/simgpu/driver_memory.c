/* Simulated libcuda.so.1: device memory. Every byte an allocation holds is
 * charged to the shared GPU state, so memory runs out across processes and
 * is returned when a process dies (simstate.c reaps its slot). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "driver.h"

#define VMM_GRANULARITY (2ULL << 20)
#define PITCH_ALIGN 512
#define TABLE_BUCKETS (sizeof(sim_drv.allocs) / sizeof(sim_drv.allocs[0]))

enum alloc_kind { ALLOC_MEMORY, ALLOC_RESERVED, ALLOC_MAPPED, ALLOC_IPC /* another process's, opened */ };

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

struct sim_array {
    uint32_t magic;
    int dev;
    uint64_t size;
};

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

/* Contents of device memory live in host pages mapped when a copy or fill
 * first touches the allocation, so memory only ever charged (the usual
 * case: the simulation runs no kernels) costs no host memory, and touched
 * memory costs only the pages touched (MAP_NORESERVE). */
static void *backing_map(uint64_t size)
{
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void backing_unmap(void *p, uint64_t size)
{
    if (p)
        munmap(p, (size_t)size);
}

static size_t bucket_of(CUdeviceptr p)
{
    return (size_t)((p >> 9) * 0x9E3779B97F4A7C15ULL >> 52) % TABLE_BUCKETS;
}

void sim_forget_allocations(void)
{
    for (size_t b = 0; b < TABLE_BUCKETS; b++) {
        for (struct alloc_entry *e = sim_drv.allocs[b], *next; e; e = next) {
            next = e->next;
            backing_unmap(e->bytes, e->size);
            if (e->fd >= 0)
                close(e->fd);
            free(e);
        }
        sim_drv.allocs[b] = NULL;
    }
}

/* Caller holds sim_drv.lock. */
static CUdeviceptr take_va(int dev, uint64_t size, uint64_t align)
{
    uint64_t a = align > PITCH_ALIGN ? align : PITCH_ALIGN;
    uint64_t p = (sim_drv.next_va[dev] + a - 1) & ~(a - 1);
    sim_drv.next_va[dev] = p + (size ? size : 1);
    return (CUdeviceptr)p;
}

CUdeviceptr sim_graph_va(int dev, uint64_t size)
{
    pthread_mutex_lock(&sim_drv.lock);
    CUdeviceptr p = take_va(dev, size, VMM_GRANULARITY);
    pthread_mutex_unlock(&sim_drv.lock);
    return p;
}

static void table_link(struct alloc_entry *e)
{
    size_t b = bucket_of(e->ptr);
    e->next = sim_drv.allocs[b];
    sim_drv.allocs[b] = e;
}

static CUresult table_insert(CUdeviceptr ptr, uint64_t size, int dev, enum alloc_kind kind,
                             struct sim_memhandle *handle)
{
    struct alloc_entry *e = malloc(sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *e = (struct alloc_entry){.ptr = ptr, .size = size, .dev = dev, .kind = kind, .handle = handle,
                              .id = ++sim_drv.next_buffer_id, .fd = -1};
    table_link(e);
    return CUDA_SUCCESS;
}

/* Unlinks and returns the entry starting at ptr of the given kind, or NULL.
 * Caller holds sim_drv.lock and frees the entry. */
static struct alloc_entry *table_remove(CUdeviceptr ptr, enum alloc_kind kind)
{
    for (struct alloc_entry **pp = &sim_drv.allocs[bucket_of(ptr)]; *pp; pp = &(*pp)->next) {
        if ((*pp)->ptr == ptr && (*pp)->kind == kind) {
            struct alloc_entry *e = *pp;
            *pp = e->next;
            return e;
        }
    }
    return NULL;
}

#define LOW_VA_BASE 0x10000000ULL
#define LOW_VA_END 0x100000000ULL

/* An address a 32-bit CUdeviceptr_v1 can hold, or 0 when the window is
 * used up. Caller holds sim_drv.lock. */
static CUdeviceptr take_low_va(uint64_t size)
{
    uint64_t p = sim_drv.next_va_low ? sim_drv.next_va_low : LOW_VA_BASE;
    p = (p + PITCH_ALIGN - 1) & ~(uint64_t)(PITCH_ALIGN - 1);
    if (size > LOW_VA_END - p)
        return 0;
    sim_drv.next_va_low = p + size;
    return (CUdeviceptr)p;
}

/* Charges `size` to `dev` and records a device allocation; `low`: at an
 * address below 4 GiB. */
static CUresult alloc_device_at(CUdeviceptr *dptr, uint64_t size, int dev, bool low)
{
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_mem_charge(&sim_drv.shared, dev, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_drv.lock);
    CUdeviceptr p = low ? take_low_va(size) : take_va(dev, size, 0);
    CUresult rc = p ? table_insert(p, size, dev, ALLOC_MEMORY, NULL) : CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_unlock(&sim_drv.lock);
    if (rc) {
        sim_mem_release(&sim_drv.shared, dev, size);
        return rc;
    }
    *dptr = p;
    return CUDA_SUCCESS;
}

static CUresult alloc_device(CUdeviceptr *dptr, uint64_t size, int dev)
{
    return alloc_device_at(dptr, size, dev, false);
}

/* Records what kind of allocation starts at p: managed, or from a pool
 * (whose usage it then counts). */
static void tag_allocation(CUdeviceptr p, bool managed, struct sim_pool *pool)
{
    pthread_mutex_lock(&sim_drv.lock);
    for (struct alloc_entry *e = sim_drv.allocs[bucket_of(p)]; e; e = e->next) {
        if (e->ptr == p && e->kind == ALLOC_MEMORY) {
            e->managed = managed;
            e->pool = pool;
            if (pool) {
                pool->used += e->size;
                pool->used_high = pool->used > pool->used_high ? pool->used : pool->used_high;
            }
            break;
        }
    }
    pthread_mutex_unlock(&sim_drv.lock);
}

/* The pool cuMemAllocAsync takes from on a GPU: cuDeviceSetMemPool's. */
static struct sim_pool *current_pool(int dev)
{
    return sim_drv.current_pool[dev] ? sim_drv.current_pool[dev] : &sim_drv.default_pool[dev];
}

static CUresult free_device(CUdeviceptr dptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct alloc_entry *e = table_remove(dptr, ALLOC_MEMORY);
    if (e && e->pool)
        e->pool->used -= e->size;
    pthread_mutex_unlock(&sim_drv.lock);
    if (!e)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_release(&sim_drv.shared, e->dev, e->size);
    backing_unmap(e->bytes, e->size);
    if (e->fd >= 0)
        close(e->fd);
    free(e);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    /* A dead process's memory is free at once on a real GPU. */
    sim_reap_dead(&sim_drv.shared);
    uint64_t cap = sim_cfg()->gpu[ctx->dev].total_mem;
    uint64_t used = atomic_load(&sim_drv.shared.st->gpu[ctx->dev].used);
    *total = (size_t)cap;
    *free_bytes = (size_t)(used < cap ? cap - used : 0);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    return rc ? rc : alloc_device(dptr, bytesize, ctx->dev);
}

static CUresult alloc_pitch(CUdeviceptr *dptr, uint64_t *pitch_out, uint64_t width, uint64_t height,
                            unsigned int elem, bool low)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t pitch = (width + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN;
    if (height > UINT64_MAX / pitch)
        return CUDA_ERROR_OUT_OF_MEMORY;
    rc = alloc_device_at(dptr, pitch * height, ctx->dev, low);
    if (rc == CUDA_SUCCESS)
        *pitch_out = pitch;
    return rc;
}

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                       unsigned int ElementSizeBytes)
{
    uint64_t pitch;
    if (!pPitch)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_pitch(dptr, &pitch, WidthInBytes, Height, ElementSizeBytes, false);
    if (rc == CUDA_SUCCESS)
        *pPitch = (size_t)pitch;
    return rc;
}

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    return free_device(dptr);
}

/* ---- the 32-bit entry points of CUDA before 3.2 ------------------------------ */

SIM_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    struct sim_ctx *ctx;
    CUdeviceptr p;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc || (rc = alloc_device_at(dptr ? &p : NULL, bytesize, ctx->dev, true)))
        return rc;
    *dptr = (CUdeviceptr_v1)p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                    unsigned int Height, unsigned int ElementSizeBytes)
{
    CUdeviceptr p;
    uint64_t pitch;
    if (!dptr || !pPitch)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_pitch(&p, &pitch, WidthInBytes, Height, ElementSizeBytes, true);
    if (rc == CUDA_SUCCESS && pitch > UINT_MAX) {
        free_device(p);
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pPitch = (unsigned int)pitch;
    }
    return rc;
}

SIM_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    return free_device(dptr);
}

/* 32-bit sizes: a larger GPU reads as 4 GiB - 1, as the old ABI would. */
static unsigned int clamp32(size_t v)
{
    return v > UINT_MAX ? UINT_MAX : (unsigned int)v;
}

SIM_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total)
{
    size_t f, t;
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        *free_bytes = clamp32(f);
        *total = clamp32(t);
    }
    return rc;
}

SIM_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    size_t b;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuDeviceTotalMem_v2(&b, dev);
    if (rc == CUDA_SUCCESS)
        *bytes = clamp32(b);
    return rc;
}

SIM_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    rc = CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&sim_drv.lock);
    for (size_t b = 0; b < TABLE_BUCKETS && rc; b++) {
        for (struct alloc_entry *e = sim_drv.allocs[b]; e; e = e->next) {
            if (e->kind != ALLOC_RESERVED && dptr >= e->ptr && dptr < e->ptr + e->size) {
                if (pbase)
                    *pbase = e->ptr;
                if (psize)
                    *psize = (size_t)e->size;
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    /* Charged in full on the current GPU: the simulation does not migrate
     * pages, so managed memory behaves as if resident. */
    rc = alloc_device(dptr, bytesize, ctx->dev);
    if (rc == CUDA_SUCCESS)
        tag_allocation(*dptr, true, NULL);
    return rc;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream hStream, bool per_thread)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_stream *s;
    rc = sim_resolve_stream(hStream, per_thread, &s);
    if (!rc)
        rc = alloc_device(dptr, bytesize, s->ctx->dev);
    if (!rc)
        tag_allocation(*dptr, false, current_pool(s->ctx->dev));
    return rc;
}

SIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, hStream, false);
}

SIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, hStream, true);
}

static CUresult free_async(CUdeviceptr dptr, CUstream hStream, bool per_thread)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_stream *s;
    rc = sim_resolve_stream(hStream, per_thread, &s);
    /* Returned at once rather than when the stream reaches the free: the
     * simulation never touches the memory, only its accounting. */
    return rc ? rc : free_device(dptr);
}

SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream, false);
}

SIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream, true);
}

/* The init check and handle lookup that open the calls on a pool. */
static CUresult pool_get(CUmemoryPool pool, struct sim_pool **p)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    *p = (struct sim_pool *)pool;
    return *p && (*p)->magic == MAGIC_POOL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream,
                           bool per_thread)
{
    struct sim_pool *p;
    CUresult rc = pool_get(pool, &p);
    if (rc)
        return rc;
    struct sim_stream *s;
    rc = sim_resolve_stream(hStream, per_thread, &s);
    if (!rc)
        rc = alloc_device(dptr, bytesize, p->dev);
    if (!rc)
        tag_allocation(*dptr, false, p);
    return rc;
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                            CUstream hStream)
{
    return pool_alloc(dptr, bytesize, pool, hStream, false);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                 CUstream hStream)
{
    return pool_alloc(dptr, bytesize, pool, hStream, true);
}

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc)
        return rc;
    if (!pool_out)
        return CUDA_ERROR_INVALID_VALUE;
    *pool_out = (CUmemoryPool)&sim_drv.default_pool[phys];
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!pool || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    int phys;
    if (sim_device(poolProps->location.id, &phys))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_pool *p = malloc(sizeof(*p));
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *p = (struct sim_pool){.magic = MAGIC_POOL, .dev = phys};
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    struct sim_pool *p;
    CUresult rc = pool_get(pool, &p);
    if (rc)
        return rc;
    if (p >= sim_drv.default_pool && p < sim_drv.default_pool + SIM_MAX_GPUS)
        return CUDA_ERROR_INVALID_VALUE;
    /* Its allocations stay valid (a real driver defers the destruction
     * until they are freed); they only stop naming it. */
    pthread_mutex_lock(&sim_drv.lock);
    for (size_t b = 0; b < TABLE_BUCKETS; b++) {
        for (struct alloc_entry *e = sim_drv.allocs[b]; e; e = e->next)
            e->pool = e->pool == p ? NULL : e->pool;
    }
    if (sim_drv.current_pool[p->dev] == p)
        sim_drv.current_pool[p->dev] = NULL;
    p->magic = MAGIC_DEAD;
    pthread_mutex_unlock(&sim_drv.lock);
    free(p);
    return CUDA_SUCCESS;
}

/* ---- virtual memory management -------------------------------------------- */

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!granularity || !prop || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                                  option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = (size_t)VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!handle || !prop || flags != 0 || size == 0 || size % VMM_GRANULARITY ||
        prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = -1;
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (sim_device(prop->location.id, &dev))
            return CUDA_ERROR_INVALID_DEVICE;
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        break; /* host memory: no device memory is used */
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct sim_memhandle *h = malloc(sizeof(*h));
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (dev >= 0 && !sim_mem_charge(&sim_drv.shared, dev, size)) {
        free(h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *h = (struct sim_memhandle){.magic = MAGIC_MEMHANDLE, .dev = dev, .size = size,
                                .handle_types = prop->requestedHandleTypes};
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

/* Caller holds sim_drv.lock. Physical memory goes back once the handle is
 * released and no mapping uses it, as in the real driver. */
static void memhandle_maybe_free(struct sim_memhandle *h)
{
    if (!h->released || h->mappings > 0)
        return;
    if (h->dev >= 0 && !h->imported)
        sim_mem_release(&sim_drv.shared, h->dev, h->size);
    backing_unmap(h->bytes, h->size);
    h->magic = MAGIC_DEAD;
    free(h);
}

static struct sim_memhandle *memhandle_of(CUmemGenericAllocationHandle handle)
{
    struct sim_memhandle *h = (struct sim_memhandle *)(uintptr_t)handle;
    return h && h->magic == MAGIC_MEMHANDLE && !h->released ? h : NULL;
}

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_memhandle *h = memhandle_of(handle);
    if (h && h->retains > 0) {
        h->retains--;
    } else if (h) {
        h->released = true;
        memhandle_maybe_free(h);
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The handle behind a mapped address, one reference more: valid again even
 * if every earlier reference was released. */
SIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
    struct sim_memhandle *h = NULL;
    pthread_mutex_lock(&sim_drv.lock);
    for (size_t b = 0; b < TABLE_BUCKETS && !h; b++) {
        for (struct alloc_entry *e = sim_drv.allocs[b]; e && !h; e = e->next) {
            if (e->kind == ALLOC_MAPPED && a >= e->ptr && a - e->ptr < e->size)
                h = e->handle;
        }
    }
    if (h && h->released)
        h->released = false;
    else if (h)
        h->retains++;
    pthread_mutex_unlock(&sim_drv.lock);
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                        unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    (void)addr; /* a hint; the simulation always picks the address */
    if (!ptr || size == 0 || size % VMM_GRANULARITY || flags != 0 || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    /* Reservations live above every GPU's allocation range. */
    CUdeviceptr p = take_va(SIM_MAX_GPUS - 1, size, alignment > VMM_GRANULARITY ? alignment : VMM_GRANULARITY);
    rc = table_insert(p, size, -1, ALLOC_RESERVED, NULL);
    pthread_mutex_unlock(&sim_drv.lock);
    if (rc == CUDA_SUCCESS)
        *ptr = p;
    return rc;
}

/* Ends a reservation (only whole) or a mapping (whole whatever the size,
 * dropping its handle's count). */
static CUresult vmm_remove(CUdeviceptr ptr, size_t size, enum alloc_kind kind)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct alloc_entry *e = table_remove(ptr, kind);
    if (e && kind == ALLOC_RESERVED && e->size != size) {
        table_link(e);
        e = NULL;
    } else if (e && kind == ALLOC_MAPPED) {
        e->handle->mappings--;
        memhandle_maybe_free(e->handle);
    }
    pthread_mutex_unlock(&sim_drv.lock);
    rc = e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    free(e);
    return rc;
}

SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    return vmm_remove(ptr, size, ALLOC_RESERVED);
}

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (size == 0 || flags != 0 || offset != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_memhandle *h = memhandle_of(handle);
    if (!h || size > h->size) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((rc = table_insert(ptr, size, h->dev, ALLOC_MAPPED, h)) == CUDA_SUCCESS) {
        h->mappings++;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    return vmm_remove(ptr, size, ALLOC_MAPPED);
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!desc || count == 0 || size == 0 || ptr == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        int phys;
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || sim_device(desc[i].location.id, &phys))
            return CUDA_ERROR_INVALID_DEVICE;
    }
    return CUDA_SUCCESS;
}

/* What an exported POSIX file descriptor carries: a sealed memfd naming
 * the memory. The simulation keeps the memory charged to the exporting
 * process (an imported handle charges nothing more, as on a real GPU, but
 * neither does it keep the memory once the exporter has given it back). */
struct sim_shared_mem {
    uint64_t magic;
    int32_t dev;
    int32_t pad;
    uint64_t size;
};
#define SHARED_MEM_MAGIC 0x4d454d5348415231ULL /* "1RAHSMEM" */

SIM_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                 CUmemAllocationHandleType handleType, unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!shareableHandle || flags != 0 || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_memhandle *h = memhandle_of(handle);
    struct sim_shared_mem d = {.magic = SHARED_MEM_MAGIC};
    if (h && (h->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        d.dev = h->dev;
        d.size = h->size;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    if (!d.size)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("cgpu-sim-vmm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (pwrite(fd, &d, sizeof(d), 0) != (ssize_t)sizeof(d) ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
        close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    *(int *)shareableHandle = fd;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                   CUmemAllocationHandleType shHandleType)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!handle || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_shared_mem d;
    int fd = (int)(intptr_t)osHandle;
    if (pread(fd, &d, sizeof(d), 0) != (ssize_t)sizeof(d) || d.magic != SHARED_MEM_MAGIC || d.size == 0 ||
        d.dev < -1 || d.dev >= SIM_MAX_GPUS)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_memhandle *h = malloc(sizeof(*h));
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *h = (struct sim_memhandle){.magic = MAGIC_MEMHANDLE, .dev = d.dev, .size = d.size, .imported = true,
                                .handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR};
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                           CUmemGenericAllocationHandle handle)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_memhandle *h = memhandle_of(handle);
    if (h) {
        memset(prop, 0, sizeof(*prop));
        prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop->requestedHandleTypes = h->handle_types;
        prop->location.type = h->dev >= 0 ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST;
        prop->location.id = h->dev >= 0 ? sim_ordinal(h->dev) : 0;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- context limits that hold device memory ------------------------------------ */

#define DEFAULT_STACK 1024ULL
#define DEFAULT_FIFO (1ULL << 20)
#define DEFAULT_HEAP (8ULL << 20)
#define THREADS_PER_SM 2048ULL /* CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR */

static uint64_t limit_value(const struct sim_ctx *ctx, CUlimit l)
{
    static const uint64_t dflt[3] = {DEFAULT_STACK, DEFAULT_FIFO, DEFAULT_HEAP};
    return ctx->limit[l] ? ctx->limit[l] : dflt[l];
}

/* Device bytes the settings hold beyond the defaults: the stack for every
 * thread the GPU can hold resident, the heap and the FIFO. UINT64_MAX when
 * that cannot be counted. */
static uint64_t limits_extra(const struct sim_ctx *ctx, const uint64_t v[3])
{
    uint64_t threads = THREADS_PER_SM * sim_cfg()->gpu[ctx->dev].sm_count;
    uint64_t stack = v[CU_LIMIT_STACK_SIZE] > DEFAULT_STACK ? v[CU_LIMIT_STACK_SIZE] - DEFAULT_STACK : 0;
    uint64_t fifo = v[CU_LIMIT_PRINTF_FIFO_SIZE] > DEFAULT_FIFO ? v[CU_LIMIT_PRINTF_FIFO_SIZE] - DEFAULT_FIFO : 0;
    uint64_t heap = v[CU_LIMIT_MALLOC_HEAP_SIZE] > DEFAULT_HEAP ? v[CU_LIMIT_MALLOC_HEAP_SIZE] - DEFAULT_HEAP : 0;
    if (threads && stack > UINT64_MAX / threads)
        return UINT64_MAX;
    stack *= threads;
    return stack > UINT64_MAX - fifo - heap || fifo > UINT64_MAX - heap ? UINT64_MAX : stack + fifo + heap;
}

void sim_ctx_drop_limits(struct sim_ctx *ctx)
{
    if (ctx->limit_charged)
        sim_mem_release(&sim_drv.shared, ctx->dev, ctx->limit_charged);
    ctx->limit_charged = 0;
    memset(ctx->limit, 0, sizeof(ctx->limit));
}

SIM_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if ((unsigned)limit > CU_LIMIT_MALLOC_HEAP_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    pthread_mutex_lock(&sim_drv.lock);
    uint64_t v[3];
    for (int i = 0; i < 3; i++)
        v[i] = limit_value(ctx, (CUlimit)i);
    v[limit] = value ? value : 1;
    uint64_t want = limits_extra(ctx, v), have = ctx->limit_charged;
    if (want == UINT64_MAX || (want > have && !sim_mem_charge(&sim_drv.shared, ctx->dev, want - have))) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        if (want < have)
            sim_mem_release(&sim_drv.shared, ctx->dev, have - want);
        ctx->limit[limit] = v[limit];
        ctx->limit_charged = want;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (!pvalue)
        return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned)limit > CU_LIMIT_MALLOC_HEAP_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    pthread_mutex_lock(&sim_drv.lock);
    *pvalue = (size_t)limit_value(ctx, limit);
    pthread_mutex_unlock(&sim_drv.lock);
    return CUDA_SUCCESS;
}

/* ---- arrays ----------------------------------------------------------------- */

static uint64_t format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

/* Bytes of a W x H x D array level, 0 if the description is invalid. */
static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels)
{
    uint64_t elem = format_bytes(f);
    if (!elem || w == 0 || (channels != 1 && channels != 2 && channels != 4))
        return 0;
    uint64_t n = (uint64_t)w * (h ? h : 1);
    if (d && n > UINT64_MAX / d)
        return 0;
    n *= d ? d : 1;
    return n > UINT64_MAX / (elem * channels) ? 0 : n * elem * channels;
}

static CUresult create_array(void **out, uint64_t bytes)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (!out || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_array *a = malloc(sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!sim_mem_charge(&sim_drv.shared, ctx->dev, bytes)) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *a = (struct sim_array){.magic = MAGIC_ARRAY, .dev = ctx->dev, .size = bytes};
    *out = a;
    return CUDA_SUCCESS;
}

static CUresult destroy_array(void *handle)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_array *a = handle;
    if (!a || a->magic != MAGIC_ARRAY)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_mem_release(&sim_drv.shared, a->dev, a->size);
    a->magic = MAGIC_DEAD;
    free(a);
    return CUDA_SUCCESS;
}

/* maxTexture2D / maxTexture3D of a compute capability 9.0 GPU. */
#define MAX_2D_WIDTH 131072
#define MAX_2D_HEIGHT 65536
#define MAX_3D_EXTENT 16384

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (!pHandle || !d || d->Width > MAX_2D_WIDTH || d->Height > MAX_2D_HEIGHT)
        return CUDA_ERROR_INVALID_VALUE;
    return create_array((void **)pHandle, array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels));
}

static bool extent3d_ok(const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (d->Depth == 0)
        return d->Width <= MAX_2D_WIDTH && d->Height <= MAX_2D_HEIGHT;
    return d->Width <= MAX_3D_EXTENT && d->Height <= MAX_3D_EXTENT && d->Depth <= MAX_3D_EXTENT;
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (!pHandle || !d || !extent3d_ok(d))
        return CUDA_ERROR_INVALID_VALUE;
    return create_array((void **)pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels));
}

SIM_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    return destroy_array(hArray);
}

SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                           unsigned int numMipmapLevels)
{
    if (!pHandle || !d || numMipmapLevels == 0 || numMipmapLevels > 32 || !extent3d_ok(d))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t total = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < numMipmapLevels; l++) {
        uint64_t level = array_bytes(w, h, z, d->Format, d->NumChannels);
        if (!level || total > UINT64_MAX - level)
            return CUDA_ERROR_INVALID_VALUE;
        total += level;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        z = z > 1 ? z / 2 : z;
    }
    return create_array((void **)pHandle, total);
}

SIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    return destroy_array(hMipmappedArray);
}

SIM_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY_DESCRIPTOR wide = {d->Width, d->Height, d->Format, d->NumChannels};
    return cuArrayCreate_v2(pHandle, &wide);
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR wide = {d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags};
    return cuArray3DCreate_v2(pHandle, &wide);
}

/* ---- pinned host memory ------------------------------------------------------ */

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

/* The record whose range holds p, or NULL. Caller holds sim_drv.lock. */
static struct sim_host_mem *pinned_at(const void *p)
{
    for (struct sim_host_mem *m = sim_drv.pinned; m; m = m->next) {
        if ((const char *)p >= m->base && (const char *)p - m->base < (ptrdiff_t)m->size)
            return m;
    }
    return NULL;
}

static CUresult pinned_add(void *base, size_t size, unsigned flags, bool registered)
{
    struct sim_host_mem *m = malloc(sizeof(*m));
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *m = (struct sim_host_mem){.base = base, .size = size, .flags = flags, .registered = registered,
                               .id = ++sim_drv.next_buffer_id};
    m->next = sim_drv.pinned;
    sim_drv.pinned = m;
    return CUDA_SUCCESS;
}

/* Unlinks the record starting at p of the given sort. Caller holds
 * sim_drv.lock and frees it. */
static struct sim_host_mem *pinned_remove(const void *p, bool registered)
{
    for (struct sim_host_mem **pp = &sim_drv.pinned; *pp; pp = &(*pp)->next) {
        if ((*pp)->base == p && (*pp)->registered == registered) {
            struct sim_host_mem *m = *pp;
            *pp = m->next;
            return m;
        }
    }
    return NULL;
}

SIM_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (!pp || bytesize == 0 ||
        (Flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED)))
        return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&sim_drv.lock);
    rc = pinned_add(p, bytesize, Flags, false);
    pthread_mutex_unlock(&sim_drv.lock);
    if (rc) {
        munmap(p, bytesize);
        return rc;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return cuMemHostAlloc(pp, bytesize, 0);
}

SIM_EXPORT CUresult cuMemFreeHost(void *p)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_host_mem *m = pinned_remove(p, false);
    pthread_mutex_unlock(&sim_drv.lock);
    if (!m)
        return CUDA_ERROR_INVALID_VALUE;
    munmap(m->base, m->size);
    free(m);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (!p || bytesize == 0 || (Flags & ~(unsigned)(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                                                    CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY)))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    bool overlap = false;
    for (struct sim_host_mem *m = sim_drv.pinned; m && !overlap; m = m->next)
        overlap = (char *)p < m->base + m->size && m->base < (char *)p + bytesize;
    rc = overlap ? CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED : pinned_add(p, bytesize, Flags, true);
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemHostUnregister(void *p)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_host_mem *m = pinned_remove(p, true);
    pthread_mutex_unlock(&sim_drv.lock);
    free(m);
    return m ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

/* With unified addressing (CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING is 1)
 * pinned memory has the same address on the device as on the host. */
SIM_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if (!pdptr || !p || Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    bool found = pinned_at(p) != NULL;
    pthread_mutex_unlock(&sim_drv.lock);
    if (!found)
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

/* Unified addressing makes every pinned allocation portable and mapped
 * (cuMemHostAlloc's documentation), whatever flags it was made with. */
SIM_EXPORT CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!pFlags || !p)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_host_mem *m = pinned_at(p);
    if (m && !m->registered)
        *pFlags = m->flags | CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP;
    pthread_mutex_unlock(&sim_drv.lock);
    return m && !m->registered ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- copies and fills ------------------------------------------------------------ */

/* The allocation or mapping holding device address p, or NULL: its start
 * first (the common case, one bucket), then every range. Caller holds
 * sim_drv.lock. */
static struct alloc_entry *entry_at(CUdeviceptr p)
{
    for (struct alloc_entry *e = sim_drv.allocs[bucket_of(p)]; e; e = e->next) {
        if (e->ptr == p && e->kind != ALLOC_RESERVED)
            return e;
    }
    for (size_t b = 0; b < TABLE_BUCKETS; b++) {
        for (struct alloc_entry *e = sim_drv.allocs[b]; e; e = e->next) {
            if (e->kind != ALLOC_RESERVED && p >= e->ptr && p - e->ptr < e->size)
                return e;
        }
    }
    return NULL;
}

/* Where n bytes at a unified address live in this process: device memory's
 * backing (mapped on first touch) or, for an address no device allocation
 * holds, the host memory at that address, as unified addressing lets a copy
 * take pageable host memory. A range running past its allocation, or device
 * addresses the driver handed out and no allocation holds any more, are
 * invalid. Caller holds sim_drv.lock. */
static CUresult bytes_at(CUdeviceptr p, size_t n, void **out)
{
    if (p == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct alloc_entry *hit = entry_at(p);
    if (!hit) {
        for (int d = 0; d < SIM_MAX_GPUS; d++) {
            if (p >= SIM_VA_BASE(d) && p < sim_drv.next_va[d])
                return CUDA_ERROR_INVALID_VALUE; /* freed, reserved or a graph's: no bytes here */
        }
        *out = (void *)(uintptr_t)p;
        return CUDA_SUCCESS;
    }
    if (n > hit->size - (p - hit->ptr))
        return CUDA_ERROR_INVALID_VALUE;
    void **backing = hit->kind == ALLOC_MAPPED ? &hit->handle->bytes : &hit->bytes;
    uint64_t size = hit->kind == ALLOC_MAPPED ? hit->handle->size : hit->size;
    if (!*backing && !(*backing = backing_map(size)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = (char *)*backing + (p - hit->ptr);
    return CUDA_SUCCESS;
}

/* The stream a copy is ordered on; `sync`: the call returns once the work
 * queued before it is done, as a synchronous copy does (on the legacy
 * stream that is all of the context's blocking work). */
static CUresult copy_stream(CUstream h, bool per_thread, bool sync, struct sim_stream **out)
{
    CUresult rc = sim_check_init();
    if (rc || (rc = sim_resolve_stream(h, per_thread, out)))
        return rc;
    if (sync) {
        uint64_t end = *out == &(*out)->ctx->legacy ? atomic_load(&(*out)->ctx->last_end) : atomic_load(&(*out)->tail);
        if (end > sim_now_ns())
            sim_sleep_until(end);
    }
    return CUDA_SUCCESS;
}

/* The bytes move when the call is made, asynchronous or not: simulated
 * kernels never read or write memory, so nothing queued before the copy can
 * change what it moves, and the copy itself takes no simulated time. The
 * lock is held across the move so that a concurrent free cannot unmap the
 * backing under it. */
static CUresult copy(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h, bool per_thread, bool sync)
{
    struct sim_stream *s;
    CUresult rc = copy_stream(h, per_thread, sync, &s);
    if (rc || n == 0)
        return rc;
    void *d, *from;
    pthread_mutex_lock(&sim_drv.lock);
    rc = bytes_at(dst, n, &d);
    if (!rc)
        rc = bytes_at(src, n, &from);
    if (!rc)
        memmove(d, from, n);
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

/* Bytes from the first row's start to the last row's end, or 0 when that
 * overflows. */
static size_t span_2d(size_t pitch, size_t width, size_t height)
{
    size_t rows, span;
    if (__builtin_mul_overflow(height - 1, pitch, &rows) || __builtin_add_overflow(rows, width, &span))
        return 0;
    return span;
}

/* `height` rows of `width` elements of `elem` bytes, rows `pitch` bytes
 * apart, set to `value`. */
static CUresult fill_2d(CUdeviceptr dst, size_t pitch, unsigned value, size_t elem, size_t width, size_t height,
                        CUstream h, bool per_thread, bool sync)
{
    struct sim_stream *s;
    CUresult rc = copy_stream(h, per_thread, sync, &s);
    if (rc || width == 0 || height == 0)
        return rc;
    size_t row;
    if (dst % elem || __builtin_mul_overflow(width, elem, &row) || (height > 1 && (pitch < row || pitch % elem)))
        return CUDA_ERROR_INVALID_VALUE;
    size_t span = height > 1 ? span_2d(pitch, row, height) : row;
    if (!span)
        return CUDA_ERROR_INVALID_VALUE;
    char *d;
    pthread_mutex_lock(&sim_drv.lock);
    rc = bytes_at(dst, span, (void **)&d);
    for (size_t y = 0; !rc && y < height; y++) {
        char *line = d + y * pitch;
        if (elem == 1) {
            memset(line, (int)value, width);
        } else {
            uint32_t v = value;
            for (size_t i = 0; i < width; i++)
                memcpy(line + i * elem, &v, elem); /* little-endian: the low bytes */
        }
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

static CUresult fill(CUdeviceptr dst, unsigned value, size_t elem, size_t count, CUstream h, bool per_thread,
                     bool sync)
{
    return fill_2d(dst, 0, value, elem, count, 1, h, per_thread, sync);
}

#define HOST(p) ((CUdeviceptr)(uintptr_t)(p))

SIM_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return copy(dst, src, ByteCount, NULL, false, true);
}

SIM_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    return copy(dst, src, ByteCount, NULL, true, true);
}

SIM_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    return copy(dst, src, ByteCount, hStream, false, false);
}

SIM_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    return copy(dst, src, ByteCount, hStream, true, false);
}

SIM_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return copy(dstDevice, HOST(srcHost), ByteCount, NULL, false, true);
}

SIM_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    return copy(dstDevice, HOST(srcHost), ByteCount, NULL, true, true);
}

SIM_EXPORT CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy(HOST(dstHost), srcDevice, ByteCount, NULL, false, true);
}

SIM_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy(HOST(dstHost), srcDevice, ByteCount, NULL, true, true);
}

SIM_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy(dstDevice, srcDevice, ByteCount, NULL, false, true);
}

SIM_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    return copy(dstDevice, srcDevice, ByteCount, NULL, true, true);
}

SIM_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                         CUstream hStream)
{
    return copy(dstDevice, HOST(srcHost), ByteCount, hStream, false, false);
}

SIM_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                              CUstream hStream)
{
    return copy(dstDevice, HOST(srcHost), ByteCount, hStream, true, false);
}

SIM_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
{
    return copy(HOST(dstHost), srcDevice, ByteCount, hStream, false, false);
}

SIM_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                              CUstream hStream)
{
    return copy(HOST(dstHost), srcDevice, ByteCount, hStream, true, false);
}

SIM_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                         CUstream hStream)
{
    return copy(dstDevice, srcDevice, ByteCount, hStream, false, false);
}

SIM_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                              CUstream hStream)
{
    return copy(dstDevice, srcDevice, ByteCount, hStream, true, false);
}

SIM_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    return fill(dstDevice, uc, 1, N, NULL, false, true);
}

SIM_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    return fill(dstDevice, uc, 1, N, NULL, true, true);
}

SIM_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    return fill(dstDevice, ui, 4, N, NULL, false, true);
}

SIM_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    return fill(dstDevice, ui, 4, N, NULL, true, true);
}

SIM_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    return fill(dstDevice, uc, 1, N, hStream, false, false);
}

SIM_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    return fill(dstDevice, uc, 1, N, hStream, true, false);
}

SIM_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    return fill(dstDevice, ui, 4, N, hStream, false, false);
}

SIM_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    return fill(dstDevice, ui, 4, N, hStream, true, false);
}

/* ---- pools -------------------------------------------------------------------------- */

SIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc)
        return rc;
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    *pool = (CUmemoryPool)current_pool(phys);
    pthread_mutex_unlock(&sim_drv.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    int phys;
    struct sim_pool *p;
    CUresult rc = sim_device(dev, &phys);
    if (rc || (rc = pool_get(pool, &p)))
        return rc;
    if (p->dev != phys)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&sim_drv.lock);
    sim_drv.current_pool[phys] = p == &sim_drv.default_pool[phys] ? NULL : p;
    pthread_mutex_unlock(&sim_drv.lock);
    return CUDA_SUCCESS;
}

/* Nothing is kept beyond what is allocated: nothing to trim. */
SIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    struct sim_pool *p;
    (void)minBytesToKeep;
    return pool_get(pool, &p);
}

/* Value types as the driver's: int for the reuse switches, cuuint64_t for
 * the sizes. The high-water marks can only be reset (to the current use). */
SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    struct sim_pool *p;
    CUresult rc = pool_get(pool, &p);
    if (rc)
        return rc;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        p->reuse_off[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES] = *(int *)value == 0;
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: p->release_threshold = *(cuuint64_t *)value; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (*(cuuint64_t *)value != 0)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            p->used_high = p->used;
        break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    struct sim_pool *p;
    CUresult rc = pool_get(pool, &p);
    if (rc)
        return rc;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        *(int *)value = !p->reuse_off[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES];
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = p->release_threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = p->used; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = p->used_high; break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

/* ---- pointer attributes -------------------------------------------------------------- */

/* What the driver knows of an address. */
struct ptr_info {
    bool device;                  /* device memory (else pinned host memory) */
    bool managed, legacy_ipc, vmm;
    int dev;                      /* simulated GPU; -1: host memory */
    CUdeviceptr base;
    uint64_t size, id;
    struct sim_pool *pool;
    CUmemAllocationHandleType handle_types;
};

static bool pointer_info(CUdeviceptr p, struct ptr_info *out)
{
    bool found = true;
    pthread_mutex_lock(&sim_drv.lock);
    const struct alloc_entry *e = p ? entry_at(p) : NULL;
    const struct sim_host_mem *m = p && !e ? pinned_at((const void *)(uintptr_t)p) : NULL;
    if (e) {
        bool vmm = e->kind == ALLOC_MAPPED;
        *out = (struct ptr_info){.device = e->dev >= 0, .managed = e->managed, .vmm = vmm,
                                 .legacy_ipc = !vmm && !e->managed && !e->pool, .dev = e->dev, .base = e->ptr,
                                 .size = e->size, .id = e->id, .pool = e->pool,
                                 .handle_types = vmm ? e->handle->handle_types : CU_MEM_HANDLE_TYPE_NONE};
    } else if (m) {
        *out = (struct ptr_info){.dev = -1, .base = (CUdeviceptr)(uintptr_t)m->base, .size = m->size, .id = m->id};
    } else {
        found = false;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return found;
}

/* Sizes as the driver writes them: booleans are one byte (NVIDIA's own
 * Python bindings read them as bool), the memory type, handle types, RDMA
 * capability and access flags unsigned int. */
static CUresult pointer_attribute(void *data, CUpointer_attribute attr, CUdeviceptr p, const struct ptr_info *in)
{
    struct sim_ctx *cur = sim_current_ctx();
    int dev = in->dev >= 0 ? in->dev : sim_ctx_valid(cur) ? cur->dev : sim_drv.visible[0];
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        /* The simulation does not record the allocating context: the
         * current one if on that GPU, else the GPU's primary context. */
        *(CUcontext *)data = (CUcontext)(sim_ctx_valid(cur) && cur->dev == dev ? cur : &sim_drv.primary[dev]);
        break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned *)data = in->device ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = p; break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (in->device && !in->managed)
            return CUDA_ERROR_INVALID_VALUE; /* not reachable from the host */
        *(void **)data = (void *)(uintptr_t)p;
        break;
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS: return CUDA_ERROR_NOT_SUPPORTED; /* no nv-p2p kernel interface */
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: *(bool *)data = false; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: *(unsigned long long *)data = in->id; break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(bool *)data = in->managed; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = sim_ordinal(dev); break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(bool *)data = in->legacy_ipc; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: *(CUdeviceptr *)data = in->base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: *(size_t *)data = (size_t)in->size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(bool *)data = true; break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: *(unsigned *)data = in->handle_types; break;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: *(unsigned *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: *(unsigned *)data = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE; break;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *(CUmemoryPool *)data = (CUmemoryPool)in->pool; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct ptr_info info;
    if (!data || !pointer_info(ptr, &info))
        return CUDA_ERROR_INVALID_VALUE;
    return pointer_attribute(data, attribute, ptr, &info);
}

/* Bytes pointer_attribute writes for an attribute; 0: unknown attribute. */
static size_t pointer_attribute_size(CUpointer_attribute attr)
{
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
    case CU_POINTER_ATTRIBUTE_MAPPED: return sizeof(bool);
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: return sizeof(unsigned);
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS: return 2 * sizeof(unsigned long long); /* CUDA_POINTER_ATTRIBUTE_P2P_TOKENS */
    case CU_POINTER_ATTRIBUTE_CONTEXT:
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: return 8;
    default: return 0;
    }
}

/* Unlike the single query, what cannot be answered is no error: an address
 * the driver does not know reads as zeros (memory type 0: unregistered),
 * and so does an attribute that does not apply (the host pointer of device
 * memory). */
SIM_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                           CUdeviceptr ptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (numAttributes == 0 || !attributes || !data)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!data[i] || !pointer_attribute_size(attributes[i]))
            return CUDA_ERROR_INVALID_VALUE;
    }
    struct ptr_info info;
    bool known = pointer_info(ptr, &info);
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!known || pointer_attribute(data[i], attributes[i], ptr, &info) != CUDA_SUCCESS)
            memset(data[i], 0, pointer_attribute_size(attributes[i]));
    }
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    return fill(dstDevice, us, 2, N, NULL, false, true);
}

SIM_EXPORT CUresult cuMemsetD16_v2_ptds(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    return fill(dstDevice, us, 2, N, NULL, true, true);
}

SIM_EXPORT CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    return fill(dstDevice, us, 2, N, hStream, false, false);
}

SIM_EXPORT CUresult cuMemsetD16Async_ptsz(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    return fill(dstDevice, us, 2, N, hStream, true, false);
}

/* The 2D fills: one entry point per element size, synchronous or not, with
 * their per-thread variants. */
#define FILL_2D(name, type, elem)                                                                                  \
    SIM_EXPORT CUresult name##_v2(CUdeviceptr dstDevice, size_t dstPitch, type v, size_t Width, size_t Height)     \
    {                                                                                                              \
        return fill_2d(dstDevice, dstPitch, v, elem, Width, Height, NULL, false, true);                           \
    }                                                                                                              \
    SIM_EXPORT CUresult name##_v2_ptds(CUdeviceptr dstDevice, size_t dstPitch, type v, size_t Width, size_t Height) \
    {                                                                                                              \
        return fill_2d(dstDevice, dstPitch, v, elem, Width, Height, NULL, true, true);                            \
    }                                                                                                              \
    SIM_EXPORT CUresult name##Async(CUdeviceptr dstDevice, size_t dstPitch, type v, size_t Width, size_t Height,   \
                                    CUstream hStream)                                                              \
    {                                                                                                              \
        return fill_2d(dstDevice, dstPitch, v, elem, Width, Height, hStream, false, false);                       \
    }                                                                                                              \
    SIM_EXPORT CUresult name##Async_ptsz(CUdeviceptr dstDevice, size_t dstPitch, type v, size_t Width,            \
                                         size_t Height, CUstream hStream)                                          \
    {                                                                                                              \
        return fill_2d(dstDevice, dstPitch, v, elem, Width, Height, hStream, true, false);                        \
    }
FILL_2D(cuMemsetD2D8, unsigned char, 1)
FILL_2D(cuMemsetD2D16, unsigned short, 2)
FILL_2D(cuMemsetD2D32, unsigned int, 4)
#undef FILL_2D

/* One side of a 2D copy as a unified address. Arrays hold no bytes in the
 * simulation (they are only charged), so copies to or from them are not
 * supported. */
static CUresult copy_side(CUmemorytype type, const void *host, CUdeviceptr dev, CUdeviceptr *out)
{
    switch (type) {
    case CU_MEMORYTYPE_HOST: *out = HOST(host); return CUDA_SUCCESS;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED: *out = dev; return CUDA_SUCCESS;
    case CU_MEMORYTYPE_ARRAY: return CUDA_ERROR_NOT_SUPPORTED;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult copy_2d(const CUDA_MEMCPY2D *c, CUstream h, bool per_thread, bool sync)
{
    struct sim_stream *s;
    CUresult rc = copy_stream(h, per_thread, sync, &s);
    if (rc)
        return rc;
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr src, dst;
    if ((rc = copy_side(c->srcMemoryType, c->srcHost, c->srcDevice, &src)) ||
        (rc = copy_side(c->dstMemoryType, c->dstHost, c->dstDevice, &dst)))
        return rc;
    size_t w = c->WidthInBytes, rows = c->Height;
    if (w == 0 || rows == 0)
        return CUDA_SUCCESS;
    size_t sp = rows > 1 ? c->srcPitch : w, dp = rows > 1 ? c->dstPitch : w;
    size_t src_off, dst_off;
    if (sp < w || dp < w || __builtin_mul_overflow(c->srcY, sp, &src_off) ||
        __builtin_add_overflow(src_off, c->srcXInBytes, &src_off) || __builtin_mul_overflow(c->dstY, dp, &dst_off) ||
        __builtin_add_overflow(dst_off, c->dstXInBytes, &dst_off))
        return CUDA_ERROR_INVALID_VALUE;
    size_t src_span = span_2d(sp, w, rows), dst_span = span_2d(dp, w, rows);
    if (!src_span || !dst_span)
        return CUDA_ERROR_INVALID_VALUE;
    char *d, *f;
    pthread_mutex_lock(&sim_drv.lock);
    rc = bytes_at(dst + dst_off, dst_span, (void **)&d);
    if (!rc)
        rc = bytes_at(src + src_off, src_span, (void **)&f);
    for (size_t y = 0; !rc && y < rows; y++)
        memmove(d + y * dp, f + y * sp, w);
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, false, true);
}

SIM_EXPORT CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, true, true);
}

/* The simulation moves bytes, not cache lines: alignment changes nothing. */
SIM_EXPORT CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, false, true);
}

SIM_EXPORT CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *pCopy)
{
    return copy_2d(pCopy, NULL, true, true);
}

SIM_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    return copy_2d(pCopy, hStream, false, false);
}

SIM_EXPORT CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    return copy_2d(pCopy, hStream, true, false);
}

/* Unified addressing names every byte of every GPU: a peer copy is a copy
 * once both contexts are known good. */
static CUresult copy_peer(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx, size_t n,
                          CUstream h, bool per_thread, bool sync)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_ctx_valid((struct sim_ctx *)dst_ctx) || !sim_ctx_valid((struct sim_ctx *)src_ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return copy(dst, src, n, h, per_thread, sync);
}

SIM_EXPORT CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                 CUcontext srcContext, size_t ByteCount)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, NULL, false, true);
}

SIM_EXPORT CUresult cuMemcpyPeer_ptds(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                      CUcontext srcContext, size_t ByteCount)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, NULL, true, true);
}

SIM_EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                      CUcontext srcContext, size_t ByteCount, CUstream hStream)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream, false, false);
}

SIM_EXPORT CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                           CUcontext srcContext, size_t ByteCount, CUstream hStream)
{
    return copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream, true, false);
}

/* ---- managed memory hints ---------------------------------------------------------- */

/* The simulation keeps managed memory resident on its GPU and never
 * migrates it: hints and prefetches are checked as the driver checks them
 * (a managed range, a valid place) and change nothing. */
static CUresult managed_range(CUdeviceptr p, size_t count)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    const struct alloc_entry *e = entry_at(p);
    bool ok = e && e->managed && count <= e->size - (p - e->ptr);
    pthread_mutex_unlock(&sim_drv.lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* A GPU ordinal or the host (CU_DEVICE_CPU). */
static CUresult place_ok(CUdevice dev)
{
    int phys;
    return dev == CU_DEVICE_CPU || sim_device(dev, &phys) == CUDA_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static CUresult location_ok(CUmemLocation loc)
{
    switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE: return place_ok(loc.id);
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult advise(CUdeviceptr p, size_t count, CUmem_advise advice, CUresult place)
{
    CUresult rc = managed_range(p, count);
    if (rc)
        return rc;
    if (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY)
        return CUDA_ERROR_INVALID_VALUE;
    /* Read-mostly names no place; the others do. */
    return advice == CU_MEM_ADVISE_SET_READ_MOSTLY || advice == CU_MEM_ADVISE_UNSET_READ_MOSTLY ? CUDA_SUCCESS : place;
}

SIM_EXPORT CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device)
{
    return advise(devPtr, count, advice, place_ok(device));
}

SIM_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUmemLocation location)
{
    return advise(devPtr, count, advice, location_ok(location));
}

static CUresult prefetch(CUdeviceptr p, size_t count, CUresult place, CUstream h, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = managed_range(p, count);
    if (rc || (rc = place) || (rc = sim_resolve_stream(h, per_thread, &s)))
        return rc;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream)
{
    return prefetch(devPtr, count, place_ok(dstDevice), hStream, false);
}

SIM_EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream)
{
    return prefetch(devPtr, count, place_ok(dstDevice), hStream, true);
}

SIM_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                          CUstream hStream)
{
    return flags ? CUDA_ERROR_INVALID_VALUE : prefetch(devPtr, count, location_ok(location), hStream, false);
}

SIM_EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                               unsigned int flags, CUstream hStream)
{
    return flags ? CUDA_ERROR_INVALID_VALUE : prefetch(devPtr, count, location_ok(location), hStream, true);
}

/* ---- host functions in stream order ------------------------------------------------- */

/* A host function runs once the work queued before it on the stream is
 * done, and work queued after it waits for it. The simulation runs it in
 * the calling thread at that moment, so the call returns after the function
 * did (a real driver returns at once and runs it on its own thread): the
 * order is the driver's, only the caller waits longer. A capturing stream
 * would need a host node, which the simulation's capture does not make. */
static CUresult host_func(CUstream h, bool per_thread, CUhostFn fn, CUstreamCallback cb, void *data)
{
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = per_thread ? cuStreamIsCapturing_ptsz(h, &capture) : cuStreamIsCapturing(h, &capture);
    if (rc)
        return rc;
    if (capture != CU_STREAM_CAPTURE_STATUS_NONE)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct sim_stream *s;
    if ((rc = copy_stream(h, per_thread, true, &s)))
        return rc;
    if (fn)
        fn(data);
    else
        cb(h, CUDA_SUCCESS, data);
    return CUDA_SUCCESS;
}

static CUresult launch_host(CUstream h, bool per_thread, CUhostFn fn, void *data)
{
    return fn ? host_func(h, per_thread, fn, NULL, data) : CUDA_ERROR_INVALID_VALUE;
}

static CUresult add_callback(CUstream h, bool per_thread, CUstreamCallback cb, void *data, unsigned flags)
{
    return cb && flags == 0 ? host_func(h, per_thread, NULL, cb, data) : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    return launch_host(hStream, false, fn, userData);
}

SIM_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    return launch_host(hStream, true, fn, userData);
}

SIM_EXPORT CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData, unsigned int flags)
{
    return add_callback(hStream, false, callback, userData, flags);
}

SIM_EXPORT CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void *userData,
                                             unsigned int flags)
{
    return add_callback(hStream, true, callback, userData, flags);
}

/* ---- legacy IPC memory handles -------------------------------------------------------- */

/* What a CUipcMemHandle carries: the exporting process and the memfd that
 * holds the allocation's bytes there, which another process opens through
 * /proc/PID/fd (as root or as the same user, the conditions of a real
 * driver's IPC too). The memory stays charged to the exporter; an open adds
 * nothing, as on a real GPU. */
struct sim_ipc_handle {
    uint64_t magic;
    int32_t pid, fd, dev, pad;
    uint64_t size;
};
#define IPC_MAGIC 0x3143504943504753ULL /* "SGPCIPC1" */
_Static_assert(sizeof(struct sim_ipc_handle) <= CU_IPC_HANDLE_SIZE, "an IPC handle holds 64 bytes");

/* Moves an allocation's bytes into a memfd so that other processes can map
 * them: only the pages holding something are copied. Caller holds
 * sim_drv.lock. */
static CUresult share_backing(struct alloc_entry *e)
{
    int fd = memfd_create("cgpu-sim-ipc", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)e->size) != 0) {
        if (fd >= 0)
            close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    void *map = mmap(NULL, (size_t)e->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (map == MAP_FAILED) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (e->bytes) {
        static const char zero[4096];
        for (uint64_t off = 0; off < e->size; off += sizeof(zero)) {
            size_t n = e->size - off < sizeof(zero) ? (size_t)(e->size - off) : sizeof(zero);
            if (memcmp((char *)e->bytes + off, zero, n) != 0)
                memcpy((char *)map + off, (char *)e->bytes + off, n);
        }
        backing_unmap(e->bytes, e->size);
    }
    e->bytes = map;
    e->fd = fd;
    return CUDA_SUCCESS;
}

/* Only memory from cuMemAlloc and its kin can be shared this way
 * (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE). */
SIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!pHandle)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    struct alloc_entry *e = entry_at(dptr);
    if (!e || e->kind != ALLOC_MEMORY || e->managed || e->pool)
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (e->fd < 0)
        rc = share_backing(e);
    if (!rc) {
        struct sim_ipc_handle h = {.magic = IPC_MAGIC, .pid = (int32_t)getpid(), .fd = e->fd, .dev = e->dev,
                                   .size = e->size};
        memset(pHandle, 0, sizeof(*pHandle));
        memcpy(pHandle->reserved, &h, sizeof(h));
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    struct sim_ipc_handle h;
    memcpy(&h, handle.reserved, sizeof(h));
    if (!pdptr || (Flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) || h.magic != IPC_MAGIC || h.size == 0 ||
        h.dev < 0 || h.dev >= SIM_MAX_GPUS || h.pid <= 0 || h.fd < 0)
        return CUDA_ERROR_INVALID_VALUE;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)h.pid, (int)h.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE; /* the exporter is gone, or the handle forged */
    void *map = mmap(NULL, (size_t)h.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    CUdeviceptr p = take_va(h.dev, h.size, 0);
    rc = table_insert(p, h.size, h.dev, ALLOC_IPC, NULL);
    if (!rc)
        entry_at(p)->bytes = map;
    pthread_mutex_unlock(&sim_drv.lock);
    if (rc) {
        munmap(map, (size_t)h.size);
        return rc;
    }
    *pdptr = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    return cuIpcOpenMemHandle_v2(pdptr, handle, Flags);
}

SIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct alloc_entry *e = table_remove(dptr, ALLOC_IPC);
    pthread_mutex_unlock(&sim_drv.lock);
    if (!e)
        return CUDA_ERROR_INVALID_VALUE;
    backing_unmap(e->bytes, e->size);
    free(e);
    return CUDA_SUCCESS;
}
