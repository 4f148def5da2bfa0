/* Simulated libcuda.so.1: legacy IPC memory handles (cuIpcGetMemHandle). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "driver.h"
#include "memfd.h"

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
    int fd = sim_memfd("cgpu-sim-ipc", MFD_CLOEXEC);
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
        sim_backing_unmap(e->bytes, e->size);
    }
    e->bytes = map;
    e->fd = fd;
    return CUDA_SUCCESS;
}

/* Only memory from cuMemAlloc and its kin can be shared this way
 * (CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE). */
SIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    CUresult rc = sim_check_init_args(!pHandle);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    struct alloc_entry *e = sim_entry_at(dptr);
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
    CUdeviceptr p = sim_take_va(h.dev, h.size, 0);
    rc = sim_table_insert(p, h.size, h.dev, ALLOC_IPC, NULL);
    if (!rc)
        sim_entry_at(p)->bytes = map;
    pthread_mutex_unlock(&sim_drv.lock);
    if (rc) {
        munmap(map, (size_t)h.size);
        return rc;
    }
    *pdptr = p;
    return CUDA_SUCCESS;
}
