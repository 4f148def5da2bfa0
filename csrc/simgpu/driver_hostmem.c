/* Simulated libcuda.so.1: page-locked host memory. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/mman.h>

#include "driver.h"

/* The record whose range holds p, or NULL. Caller holds sim_drv.lock. */
struct sim_host_mem *sim_pinned_at(const void *p)
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
    unsigned known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
    CUresult rc = sim_require_ctx_args(&ctx, !pp || bytesize == 0 || (Flags & ~known));
    if (rc)
        return rc;
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
    unsigned known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                     CU_MEMHOSTREGISTER_READ_ONLY;
    CUresult rc = sim_require_ctx_args(&ctx, !p || bytesize == 0 || (Flags & ~known));
    if (rc)
        return rc;
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
    CUresult rc = sim_check_init_args(!p);
    if (rc)
        return rc;
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
    CUresult rc = sim_require_ctx_args(&ctx, !pdptr || !p || Flags != 0);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    bool found = sim_pinned_at(p) != NULL;
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
    CUresult rc = sim_check_init_args(!pFlags || !p);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_host_mem *m = sim_pinned_at(p);
    if (m && !m->registered)
        *pFlags = m->flags | CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP;
    pthread_mutex_unlock(&sim_drv.lock);
    return m && !m->registered ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
