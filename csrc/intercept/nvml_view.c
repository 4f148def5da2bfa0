/* libcgpu.so: what NVML (and so nvidia-smi) shows inside the instance:
 * its memory limit as the total, its own usage, its own processes. */
#include <string.h>

#include "libcgpu.h"

#define MAX_LISTED 1024

#define CALL_NVML(symbol, ...)                                                                  \
    ({                                                                                          \
        __typeof__(&symbol) real_ = REAL(symbol);                                               \
        real_ ? real_(__VA_ARGS__) : NVML_ERROR_UNINITIALIZED;                                  \
    })

/* Limit and usage of the instance on an NVML device; false if NVML is
 * not ours to change (no instance) or the device is outside it (shows 0). */
static bool instance_memory(nvmlDevice_t device, unsigned long long *limit, unsigned long long *used)
{
    if (cgpu_state() != CGPU_ACTIVE)
        return false;
    cgpu_reap_dead();
    int slot = cgpu_slot_of_nvml_device(device);
    *limit = slot >= 0 ? g_cgpu.device[slot].mem_limit : 0;
    *used = slot >= 0 ? cgpu_slot_used(slot) : 0;
    if (*used > *limit) /* a transient overshoot must not show as huge free memory */
        *used = *limit;
    return true;
}

CGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t rc = CALL_NVML(nvmlDeviceGetMemoryInfo, device, memory);
    unsigned long long limit, used;
    if (rc == NVML_SUCCESS && instance_memory(device, &limit, &used))
        *memory = (nvmlMemory_t){.total = limit, .used = used, .free = limit - used};
    return rc;
}

CGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlReturn_t rc = CALL_NVML(nvmlDeviceGetMemoryInfo_v2, device, memory);
    unsigned long long limit, used;
    if (rc == NVML_SUCCESS && instance_memory(device, &limit, &used)) {
        memory->total = limit;
        memory->reserved = 0; /* the driver's reserve is outside the instance */
        memory->used = used;
        memory->free = limit - used;
    }
    return rc;
}

/* Keeps the entries of the instance's own processes (the pid is the first
 * field of every nvmlProcessInfo version) and answers with NVML's
 * size protocol. */
static nvmlReturn_t keep_own(const unsigned char *all, unsigned int n, size_t size, unsigned int *count,
                             unsigned char *out)
{
    unsigned int mine = 0;
    for (unsigned int i = 0; i < n; i++) {
        unsigned int pid;
        memcpy(&pid, all + i * size, sizeof(pid));
        if (!cgpu_pid_in_instance(pid))
            continue;
        if (out && mine < *count)
            memcpy(out + mine * size, all + i * size, size);
        mine++;
    }
    nvmlReturn_t rc = mine > *count || (mine && !out) ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    *count = mine;
    return rc;
}

#define PROCESS_HOOK(symbol, type)                                                              \
    CGPU_EXPORT nvmlReturn_t symbol(nvmlDevice_t device, unsigned int *infoCount, type *infos)  \
    {                                                                                           \
        if (cgpu_state() != CGPU_ACTIVE || !infoCount)                                          \
            return CALL_NVML(symbol, device, infoCount, infos);                                 \
        type all[MAX_LISTED];                                                                   \
        unsigned int n = MAX_LISTED;                                                            \
        nvmlReturn_t rc = CALL_NVML(symbol, device, &n, all);                                   \
        if (rc != NVML_SUCCESS)                                                                 \
            return rc;                                                                          \
        return keep_own((const unsigned char *)all, n, sizeof(type), infoCount, (unsigned char *)infos); \
    }

PROCESS_HOOK(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROCESS_HOOK(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROCESS_HOOK(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
