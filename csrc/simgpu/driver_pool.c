/* Simulated libcuda.so.1: stream-ordered memory pools. */
#define _GNU_SOURCE
#include <stdlib.h>

#include "driver.h"

SIM_HANDLE_GET(pool_get, CUmemoryPool, struct sim_pool, MAGIC_POOL, CUDA_ERROR_INVALID_VALUE)

CUresult sim_pool_alloc(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream,
                        bool per_thread)
{
    struct sim_pool *p;
    CUresult rc = pool_get(pool, &p);
    if (rc)
        return rc;
    struct sim_stream *s;
    rc = sim_resolve_stream(hStream, per_thread, &s);
    if (!rc)
        rc = sim_alloc_device(dptr, bytesize, p->dev);
    if (!rc)
        sim_tag_allocation(*dptr, false, p);
    return rc;
}

/* Device `dev`'s default pool or, when `current`, the pool its allocations
 * come from: cuDeviceSetMemPool's, else the default. */
static CUresult device_pool(CUmemoryPool *out, CUdevice dev, bool current)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !out);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    *out = (CUmemoryPool)(current ? sim_current_pool(phys) : &sim_drv.default_pool[phys]);
    pthread_mutex_unlock(&sim_drv.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    return device_pool(pool_out, dev, false);
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
    for (size_t b = 0; b < SIM_ALLOC_BUCKETS; b++) {
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

SIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    return device_pool(pool, dev, true);
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

/* Both directions of one attribute in one place. Value types as the
 * driver's: int for the reuse switches, cuuint64_t for the sizes. The
 * current use cannot be set, and the high-water marks only reset (to the
 * current use). */
static CUresult pool_attribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value, bool set)
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
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: {
        bool *off = &p->reuse_off[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES];
        if (set)
            *off = *(int *)value == 0;
        else
            *(int *)value = !*off;
        break;
    }
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        if (set)
            p->release_threshold = *(cuuint64_t *)value;
        else
            *(cuuint64_t *)value = p->release_threshold;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        if (set)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            *(cuuint64_t *)value = p->used;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (!set)
            *(cuuint64_t *)value = p->used_high;
        else if (*(cuuint64_t *)value != 0)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            p->used_high = p->used;
        break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    return pool_attribute(pool, attr, value, true);
}

SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    return pool_attribute(pool, attr, value, false);
}
