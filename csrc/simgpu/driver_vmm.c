/* Simulated libcuda.so.1: virtual memory management (cuMemCreate,
 * cuMemAddressReserve, cuMemMap) and its shareable handles. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "driver.h"
#include "memfd.h"

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                  CUmemAllocationGranularity_flags option)
{
    CUresult rc = sim_check_init_args(!granularity || !prop || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                                      option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    if (rc)
        return rc;
    *granularity = (size_t)SIM_VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!handle || !prop || flags != 0 || size == 0 || size % SIM_VMM_GRANULARITY ||
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
    sim_backing_unmap(h->bytes, h->size);
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
    CUresult rc = sim_check_init_args(!handle);
    if (rc)
        return rc;
    CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
    struct sim_memhandle *h = NULL;
    pthread_mutex_lock(&sim_drv.lock);
    for (size_t b = 0; b < SIM_ALLOC_BUCKETS && !h; b++) {
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
    if (!ptr || size == 0 || size % SIM_VMM_GRANULARITY || flags != 0 || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&sim_drv.lock);
    /* Reservations live above every GPU's allocation range. */
    uint64_t align = alignment > SIM_VMM_GRANULARITY ? alignment : SIM_VMM_GRANULARITY;
    CUdeviceptr p = sim_take_va(SIM_MAX_GPUS - 1, size, align);
    rc = sim_table_insert(p, size, -1, ALLOC_RESERVED, NULL);
    pthread_mutex_unlock(&sim_drv.lock);
    if (rc == CUDA_SUCCESS)
        *ptr = p;
    return rc;
}

/* Ends a reservation (only whole) or a mapping (whole whatever the size,
 * dropping its handle's count). */
CUresult sim_vmm_remove(CUdeviceptr ptr, size_t size, enum alloc_kind kind)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct alloc_entry *e = sim_table_remove(ptr, kind);
    if (e && kind == ALLOC_RESERVED && e->size != size) {
        sim_table_link(e);
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

SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags)
{
    CUresult rc = sim_check_init_args(size == 0 || flags != 0 || offset != 0);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct sim_memhandle *h = memhandle_of(handle);
    if (!h || size > h->size) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((rc = sim_table_insert(ptr, size, h->dev, ALLOC_MAPPED, h)) == CUDA_SUCCESS) {
        h->mappings++;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    CUresult rc = sim_check_init_args(!desc || count == 0 || size == 0 || ptr == 0);
    if (rc)
        return rc;
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
    CUresult rc =
        sim_check_init_args(!shareableHandle || flags != 0 || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc)
        return rc;
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
    int fd = sim_memfd("cgpu-sim-vmm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
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
    CUresult rc = sim_check_init_args(!handle || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc)
        return rc;
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
    CUresult rc = sim_check_init_args(!prop);
    if (rc)
        return rc;
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
