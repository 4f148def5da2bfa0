/* libcgpu.so: what NVML (and so nvidia-smi, nvitop, gpustat) shows inside
 * the instance: its memory limit as the total, its own usage, its own
 * processes. Every NVML call that reports the device's memory size or lists
 * processes is answered here, so no path shows the whole GPU or a
 * neighbour's pid; docs/libcgpu.md lists the few that are not, and why. */
#include <stddef.h>
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
    *limit = slot >= 0 ? cgpu_mem_limit(slot) : 0;
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

/* BAR1 is the aperture the CPU maps device memory through: its size follows
 * the board's memory (rounded up to a power of two on large-BAR boards), and
 * its usage counts every process's mappings. Inside an instance no more than
 * the limit can be mapped, so that is the most it shows. */
CGPU_EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory)
{
    nvmlReturn_t rc = CALL_NVML(nvmlDeviceGetBAR1MemoryInfo, device, bar1Memory);
    unsigned long long limit, used;
    if (rc == NVML_SUCCESS && instance_memory(device, &limit, &used)) {
        if (bar1Memory->bar1Total > limit)
            bar1Memory->bar1Total = limit;
        if (bar1Memory->bar1Used > bar1Memory->bar1Total)
            bar1Memory->bar1Used = bar1Memory->bar1Total;
        bar1Memory->bar1Free = bar1Memory->bar1Total - bar1Memory->bar1Used;
    }
    return rc;
}

/* Keeps the entries of `all` whose pid (at `pid_at` in each) is one of the
 * instance's processes and answers with NVML's size protocol. */
static nvmlReturn_t keep_own(const unsigned char *all, unsigned int n, size_t size, size_t pid_at,
                             unsigned int *count, unsigned char *out)
{
    unsigned int mine = 0;
    for (unsigned int i = 0; i < n; i++) {
        unsigned int pid;
        memcpy(&pid, all + i * size + pid_at, sizeof(pid));
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

/* keep_own() for a driver's answer `rc` of per-process utilisation samples:
 * none of the instance's left is NOT_FOUND, as NVML answers when no
 * process has a sample. */
static nvmlReturn_t keep_own_samples(nvmlReturn_t rc, const unsigned char *all, unsigned int n, size_t size,
                                     size_t pid_at, unsigned int *count, unsigned char *out)
{
    if (rc == NVML_ERROR_NOT_FOUND)
        *count = 0;
    if (rc != NVML_SUCCESS)
        return rc;
    rc = keep_own(all, n, size, pid_at, count, out);
    return rc == NVML_SUCCESS && *count == 0 ? NVML_ERROR_NOT_FOUND : rc;
}

/* The pid is the first field of every nvmlProcessInfo version. */
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
        return keep_own((const unsigned char *)all, n, sizeof(type), 0, infoCount, (unsigned char *)infos); \
    }

PROCESS_HOOK(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROCESS_HOOK(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROCESS_HOOK(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
PROCESS_HOOK(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
PROCESS_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROCESS_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
PROCESS_HOOK(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
PROCESS_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
PROCESS_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

/* Per-process utilisation names pids and their share of the GPU: only the
 * instance's own. */
CGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                         nvmlProcessUtilizationSample_t *utilization,
                                                         unsigned int *processSamplesCount,
                                                         unsigned long long lastSeenTimeStamp)
{
    if (cgpu_state() != CGPU_ACTIVE || !processSamplesCount)
        return CALL_NVML(nvmlDeviceGetProcessUtilization, device, utilization, processSamplesCount,
                         lastSeenTimeStamp);
    nvmlProcessUtilizationSample_t all[MAX_LISTED];
    unsigned int n = MAX_LISTED;
    nvmlReturn_t rc = CALL_NVML(nvmlDeviceGetProcessUtilization, device, all, &n, lastSeenTimeStamp);
    return keep_own_samples(rc, (const unsigned char *)all, n, sizeof(all[0]),
                            offsetof(nvmlProcessUtilizationSample_t, pid), processSamplesCount,
                            (unsigned char *)utilization);
}

CGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                               nvmlProcessesUtilizationInfo_t *procesesUtilInfo)
{
    nvmlProcessesUtilizationInfo_t *info = procesesUtilInfo;
    if (cgpu_state() != CGPU_ACTIVE || !info)
        return CALL_NVML(nvmlDeviceGetProcessesUtilizationInfo, device, info);
    /* `all` has the v1 element: a driver told of a newer version would write
     * larger elements past it, and the caller's array has an unknown layout. */
    if (info->version != nvmlProcessesUtilizationInfo_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlProcessUtilizationInfo_v1_t all[MAX_LISTED];
    nvmlProcessesUtilizationInfo_t mine = *info;
    mine.version = nvmlProcessesUtilizationInfo_v1;
    mine.processSamplesCount = MAX_LISTED;
    mine.procUtilArray = all;
    nvmlReturn_t rc = CALL_NVML(nvmlDeviceGetProcessesUtilizationInfo, device, &mine);
    return keep_own_samples(rc, (const unsigned char *)all, mine.processSamplesCount, sizeof(all[0]),
                            offsetof(nvmlProcessUtilizationInfo_v1_t, pid), &info->processSamplesCount,
                            (unsigned char *)info->procUtilArray);
}

/* Every mode of the list, pid first in each entry. An unknown version is
 * refused, not passed on, for the same reason as above; nvml.h documents
 * INVALID_ARGUMENT for it here. */
CGPU_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist)
{
    if (cgpu_state() != CGPU_ACTIVE || !plist)
        return CALL_NVML(nvmlDeviceGetRunningProcessDetailList, device, plist);
    if (plist->version != nvmlProcessDetailList_v1)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessDetail_v1_t all[MAX_LISTED];
    nvmlProcessDetailList_t mine = *plist;
    mine.numProcArrayEntries = MAX_LISTED;
    mine.procArray = all;
    nvmlReturn_t rc = CALL_NVML(nvmlDeviceGetRunningProcessDetailList, device, &mine);
    if (rc != NVML_SUCCESS)
        return rc;
    return keep_own((const unsigned char *)all, mine.numProcArrayEntries, sizeof(all[0]),
                    offsetof(nvmlProcessDetail_v1_t, pid), &plist->numProcArrayEntries,
                    (unsigned char *)plist->procArray);
}

/* The attributes carry the device's memory size too, under the current and
 * the pre-MIG name (same struct). */
#define ATTRIBUTES_HOOK(symbol)                                                                  \
    CGPU_EXPORT nvmlReturn_t symbol(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)    \
    {                                                                                           \
        nvmlReturn_t rc = CALL_NVML(symbol, device, attributes);                                \
        unsigned long long limit, used;                                                         \
        if (rc == NVML_SUCCESS && instance_memory(device, &limit, &used))                       \
            attributes->memorySizeMB = limit >> 20;                                             \
        return rc;                                                                              \
    }

ATTRIBUTES_HOOK(nvmlDeviceGetAttributes)
ATTRIBUTES_HOOK(nvmlDeviceGetAttributes_v2)
