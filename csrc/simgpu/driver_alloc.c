/* Simulated libcuda.so.1: device allocations. Every byte an allocation
 * holds is charged to the shared GPU state, so memory runs out across
 * processes and is returned when a process dies (simstate.c reaps its
 * slot). The process's allocation table, which the other memory files
 * look addresses up in, lives here. */
#define _GNU_SOURCE
#include <limits.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "driver.h"

#define PITCH_ALIGN 512

/* Contents of device memory live in host pages mapped when a copy or fill
 * first touches the allocation, so memory only ever charged (the usual
 * case: the simulation runs no kernels) costs no host memory, and touched
 * memory costs only the pages touched (MAP_NORESERVE). */
void *sim_backing_map(uint64_t size)
{
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void sim_backing_unmap(void *p, uint64_t size)
{
    if (p)
        munmap(p, (size_t)size);
}

static size_t bucket_of(CUdeviceptr p)
{
    return (size_t)((p >> 9) * 0x9E3779B97F4A7C15ULL >> 52) % SIM_ALLOC_BUCKETS;
}

void sim_forget_allocations(void)
{
    for (size_t b = 0; b < SIM_ALLOC_BUCKETS; b++) {
        for (struct alloc_entry *e = sim_drv.allocs[b], *next; e; e = next) {
            next = e->next;
            sim_backing_unmap(e->bytes, e->size);
            if (e->fd >= 0)
                close(e->fd);
            free(e);
        }
        sim_drv.allocs[b] = NULL;
    }
}

/* Caller holds sim_drv.lock. */
CUdeviceptr sim_take_va(int dev, uint64_t size, uint64_t align)
{
    uint64_t a = align > PITCH_ALIGN ? align : PITCH_ALIGN;
    uint64_t p = (sim_drv.next_va[dev] + a - 1) & ~(a - 1);
    sim_drv.next_va[dev] = p + (size ? size : 1);
    return (CUdeviceptr)p;
}

CUdeviceptr sim_graph_va(int dev, uint64_t size)
{
    pthread_mutex_lock(&sim_drv.lock);
    CUdeviceptr p = sim_take_va(dev, size, SIM_VMM_GRANULARITY);
    pthread_mutex_unlock(&sim_drv.lock);
    return p;
}

void sim_table_link(struct alloc_entry *e)
{
    size_t b = bucket_of(e->ptr);
    e->next = sim_drv.allocs[b];
    sim_drv.allocs[b] = e;
}

CUresult sim_table_insert(CUdeviceptr ptr, uint64_t size, int dev, enum alloc_kind kind,
                          struct sim_memhandle *handle)
{
    struct alloc_entry *e = malloc(sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *e = (struct alloc_entry){.ptr = ptr, .size = size, .dev = dev, .kind = kind, .handle = handle,
                              .id = ++sim_drv.next_buffer_id, .fd = -1};
    sim_table_link(e);
    return CUDA_SUCCESS;
}

/* Unlinks and returns the entry starting at ptr of the given kind, or NULL.
 * Caller holds sim_drv.lock and frees the entry. */
struct alloc_entry *sim_table_remove(CUdeviceptr ptr, enum alloc_kind kind)
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
    CUdeviceptr p = low ? take_low_va(size) : sim_take_va(dev, size, 0);
    CUresult rc = p ? sim_table_insert(p, size, dev, ALLOC_MEMORY, NULL) : CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_unlock(&sim_drv.lock);
    if (rc) {
        sim_mem_release(&sim_drv.shared, dev, size);
        return rc;
    }
    *dptr = p;
    return CUDA_SUCCESS;
}

CUresult sim_alloc_device(CUdeviceptr *dptr, uint64_t size, int dev)
{
    return alloc_device_at(dptr, size, dev, false);
}

/* The allocation or mapping holding device address p, or NULL: its start
 * first (the common case, one bucket), then every range. Caller holds
 * sim_drv.lock. */
struct alloc_entry *sim_entry_at(CUdeviceptr p)
{
    for (struct alloc_entry *e = sim_drv.allocs[bucket_of(p)]; e; e = e->next) {
        if (e->ptr == p && e->kind != ALLOC_RESERVED)
            return e;
    }
    for (size_t b = 0; b < SIM_ALLOC_BUCKETS; b++) {
        for (struct alloc_entry *e = sim_drv.allocs[b]; e; e = e->next) {
            if (e->kind != ALLOC_RESERVED && p >= e->ptr && p - e->ptr < e->size)
                return e;
        }
    }
    return NULL;
}

/* Records what kind of allocation starts at p: managed, or from a pool
 * (whose usage it then counts). */
void sim_tag_allocation(CUdeviceptr p, bool managed, struct sim_pool *pool)
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
struct sim_pool *sim_current_pool(int dev)
{
    return sim_drv.current_pool[dev] ? sim_drv.current_pool[dev] : &sim_drv.default_pool[dev];
}

CUresult sim_free_device(CUdeviceptr dptr, enum alloc_kind kind)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct alloc_entry *e = sim_table_remove(dptr, kind);
    if (e && e->pool)
        e->pool->used -= e->size;
    pthread_mutex_unlock(&sim_drv.lock);
    if (!e)
        return CUDA_ERROR_INVALID_VALUE;
    if (kind == ALLOC_MEMORY) /* an opened IPC allocation is charged to its exporter */
        sim_mem_release(&sim_drv.shared, e->dev, e->size);
    sim_backing_unmap(e->bytes, e->size);
    if (e->fd >= 0)
        close(e->fd);
    free(e);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !free_bytes || !total);
    if (rc)
        return rc;
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
    return rc ? rc : sim_alloc_device(dptr, bytesize, ctx->dev);
}

static CUresult alloc_pitch(CUdeviceptr *dptr, uint64_t *pitch_out, uint64_t width, uint64_t height,
                            unsigned int elem, bool low)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16));
    if (rc)
        return rc;
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
        sim_free_device(p, ALLOC_MEMORY);
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pPitch = (unsigned int)pitch;
    }
    return rc;
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
    for (size_t b = 0; b < SIM_ALLOC_BUCKETS && rc; b++) {
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

CUresult sim_alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream hStream, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream(hStream, per_thread, &s);
    if (!rc)
        rc = sim_alloc_device(dptr, bytesize, s->ctx->dev);
    if (!rc)
        sim_tag_allocation(*dptr, false, sim_current_pool(s->ctx->dev));
    return rc;
}

CUresult sim_free_async(CUdeviceptr dptr, CUstream hStream, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream(hStream, per_thread, &s);
    /* Returned at once rather than when the stream reaches the free: the
     * simulation never touches the memory, only its accounting. */
    return rc ? rc : sim_free_device(dptr, ALLOC_MEMORY);
}
