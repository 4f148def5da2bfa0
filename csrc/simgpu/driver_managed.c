/* Simulated libcuda.so.1: managed memory, its hints and prefetches. */
#define _GNU_SOURCE
#include "driver.h"

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST);
    if (rc)
        return rc;
    /* Charged in full on the current GPU: the simulation does not migrate
     * pages, so managed memory behaves as if resident. */
    rc = sim_alloc_device(dptr, bytesize, ctx->dev);
    if (rc == CUDA_SUCCESS)
        sim_tag_allocation(*dptr, true, NULL);
    return rc;
}

/* The simulation keeps managed memory resident on its GPU and never
 * migrates it: hints and prefetches are checked as the driver checks them
 * (a managed range, a valid place) and change nothing. */
static CUresult managed_range(CUdeviceptr p, size_t count)
{
    CUresult rc = sim_check_init_args(count == 0);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    const struct alloc_entry *e = sim_entry_at(p);
    bool ok = e && e->managed && count <= e->size - (p - e->ptr);
    pthread_mutex_unlock(&sim_drv.lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* A GPU ordinal or the host (CU_DEVICE_CPU). */
CUresult sim_place_ok(CUdevice dev)
{
    int phys;
    return dev == CU_DEVICE_CPU || sim_device(dev, &phys) == CUDA_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult sim_location_ok(CUmemLocation loc)
{
    switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE: return sim_place_ok(loc.id);
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult sim_advise(CUdeviceptr p, size_t count, CUmem_advise advice, CUresult place)
{
    CUresult rc = managed_range(p, count);
    if (rc)
        return rc;
    if (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY)
        return CUDA_ERROR_INVALID_VALUE;
    /* Read-mostly names no place; the others do. */
    return advice == CU_MEM_ADVISE_SET_READ_MOSTLY || advice == CU_MEM_ADVISE_UNSET_READ_MOSTLY ? CUDA_SUCCESS : place;
}

CUresult sim_prefetch(CUdeviceptr p, size_t count, CUresult place, CUstream h, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = managed_range(p, count);
    if (rc || (rc = place) || (rc = sim_resolve_stream(h, per_thread, &s)))
        return rc;
    return CUDA_SUCCESS;
}
