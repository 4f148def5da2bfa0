/* Simulated libcuda.so.1: what the driver tells of an address
 * (cuPointerGetAttribute and cuPointerGetAttributes). */
#define _GNU_SOURCE
#include <string.h>

#include "driver.h"

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
    const struct alloc_entry *e = p ? sim_entry_at(p) : NULL;
    const struct sim_host_mem *m = p && !e ? sim_pinned_at((const void *)(uintptr_t)p) : NULL;
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
    CUresult rc = sim_check_init_args(numAttributes == 0 || !attributes || !data);
    if (rc)
        return rc;
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
