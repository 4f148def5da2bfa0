/* libnvidia-ml.so.1 of the simulated GPUs: NVML's real entry points and
 * error codes over the shared simulation state (simstate.h).
 *
 * NVML creates no CUDA context, so this library never claims a process slot;
 * it reads the state and reaps dead processes before reporting memory or
 * processes, as the real driver frees a process's memory when it exits.
 *
 * Thread-safety: init and shutdown count references under a process-local
 * mutex; the mapping, once made, stays for the life of the process, so a call
 * racing nvmlShutdown in another thread never touches unmapped memory. */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "cgpu/nvml_abi.h"
#include "nvml_internal.h"
#include "simmig.h"
#include "simstate.h"

/* A legacy entry point whose signature never changed: the same code under
 * both names. */
#define NVML_ALIAS(legacy, current, params) NVML_EXPORT nvmlReturn_t legacy params __attribute__((alias(#current)));

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t layout");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t layout");
_Static_assert(nvmlMemory_v2 == 0x02000028, "nvmlMemory_v2");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");
_Static_assert(sizeof(nvmlProcessUtilizationInfo_v1_t) == 40, "nvmlProcessUtilizationInfo_v1_t layout");
_Static_assert(sizeof(nvmlProcessesUtilizationInfo_v1_t) == 24, "nvmlProcessesUtilizationInfo_v1_t layout");
_Static_assert(nvmlProcessesUtilizationInfo_v1 == 0x01000018, "nvmlProcessesUtilizationInfo_v1");
_Static_assert(nvmlTemperature_v1 == 0x0100000C, "nvmlTemperature_v1");
_Static_assert(sizeof(nvmlProcessDetail_v1_t) == 32, "nvmlProcessDetail_v1_t layout");
_Static_assert(nvmlProcessDetailList_v1 == 0x01000018, "nvmlProcessDetailList_v1");

/* Window of nvmlDeviceGetUtilizationRates and the longest window of
 * nvmlDeviceGetProcessUtilization: the 1/6 s - 1 s real drivers sample. */
#define UTIL_WINDOW_NS 1000000000ULL
/* gpuInstanceId / computeInstanceId of a process outside MIG. */
#define NO_MIG_INSTANCE 0xFFFFFFFFu

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic unsigned int g_refs;
/* Written once under g_init_lock before g_attached and g_refs are set. */
struct sim_handle g_sim = {.st = NULL, .fd = -1, .slot = -1};
static atomic_bool g_attached;
/* A private copy with terminated strings: a corrupt state file cannot make
 * a string query read past its field. */
struct sim_config g_cfg;
struct nvmlDevice_st g_dev[SIM_MAX_GPUS];

static void snapshot_config(void)
{
    g_cfg = g_sim.st->config;
    if (g_cfg.gpu_count > SIM_MAX_GPUS)
        g_cfg.gpu_count = SIM_MAX_GPUS;
    if (g_cfg.mig_count > SIM_MAX_GPUS - g_cfg.gpu_count)
        g_cfg.mig_count = SIM_MAX_GPUS - g_cfg.gpu_count;
    g_cfg.driver_version_str[sizeof(g_cfg.driver_version_str) - 1] = '\0';
    for (unsigned int i = 0; i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config *g = &g_cfg.gpu[i];
        g->name[sizeof(g->name) - 1] = '\0';
        g->uuid[sizeof(g->uuid) - 1] = '\0';
        g->pci_bus_id[sizeof(g->pci_bus_id) - 1] = '\0';
        g_dev[i].index = i;
    }
}

static nvmlReturn_t init_common(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_init_lock);
    if (g_sim.st == NULL) {
        char err[512];
        if (sim_attach(&g_sim, err, sizeof(err)) != 0) {
            /* The one message a user gets about why no GPU is visible. */
            fprintf(stderr, "libnvidia-ml: %s\n", err);
            rc = NVML_ERROR_DRIVER_NOT_LOADED;
        } else {
            snapshot_config();
            atomic_store(&g_attached, true);
        }
    }
    if (rc == NVML_SUCCESS)
        atomic_fetch_add(&g_refs, 1);
    pthread_mutex_unlock(&g_init_lock);
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return init_common();
}

NVML_ALIAS(nvmlInit, nvmlInit_v2, (void))

NVML_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    /* NO_GPUS and NO_ATTACH change nothing: the simulation always has GPUs
     * and attaching them costs nothing. */
    (void)flags;
    return init_common();
}

NVML_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    unsigned int cur = atomic_load(&g_refs);
    do {
        if (cur == 0)
            return NVML_ERROR_UNINITIALIZED;
    } while (!atomic_compare_exchange_weak(&g_refs, &cur, cur - 1));
    return NVML_SUCCESS;
}

NVML_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

bool ready(void)
{
    return atomic_load(&g_refs) > 0;
}

/* Resolves a handle to its GPU without asking the GPU anything. */
static nvmlReturn_t lookup_handle(nvmlDevice_t device, unsigned int *gpu)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned int i = 0; i < g_cfg.gpu_count; i++) {
        if (device == &g_dev[i]) {
            *gpu = i;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* The first check of every device query: a GPU off the bus answers
 * nothing, as the real driver's queries fail with GPU_IS_LOST. */
nvmlReturn_t lookup(nvmlDevice_t device, unsigned int *gpu)
{
    nvmlReturn_t rc = lookup_handle(device, gpu);
    return rc == NVML_SUCCESS && sim_gpu_lost(g_sim.st, (int)*gpu) ? NVML_ERROR_GPU_IS_LOST : rc;
}

/* A handle lookup's answer for GPU i: NVIDIA documents GPU_IS_LOST for the
 * GetHandleBy* calls, and nvidia-smi shows exactly that for a lost GPU. */
nvmlReturn_t give_handle(unsigned int i, nvmlDevice_t *device)
{
    struct sim_gpu_config v;
    unsigned int gpu = i >= g_cfg.gpu_count && dev_view(i, &v) ? v.mig_parent - 1 : i;
    if (sim_gpu_lost(g_sim.st, (int)gpu))
        return NVML_ERROR_GPU_IS_LOST;
    *device = &g_dev[i];
    return NVML_SUCCESS;
}

/* lookup() for a query that writes through `out`. */
nvmlReturn_t lookup_out(nvmlDevice_t device, const void *out, unsigned int *gpu)
{
    nvmlReturn_t rc = lookup(device, gpu);
    return rc == NVML_SUCCESS && out == NULL ? NVML_ERROR_INVALID_ARGUMENT : rc;
}

/* lookup_out(), then NVML_ERROR_INVALID_ARGUMENT when `bad_args`, which is
 * worked out before the lookup and so must not use what it gives. */
static nvmlReturn_t lookup_out_args(nvmlDevice_t device, const void *out, unsigned int *gpu, bool bad_args)
{
    nvmlReturn_t rc = lookup_out(device, out, gpu);
    return rc == NVML_SUCCESS && bad_args ? NVML_ERROR_INVALID_ARGUMENT : rc;
}

/* lookup_out() for a versioned struct, whose first member is its version:
 * ARGUMENT_VERSION_MISMATCH unless that is `version`. */
static nvmlReturn_t lookup_versioned(nvmlDevice_t device, const void *out, unsigned int version, unsigned int *gpu)
{
    nvmlReturn_t rc = lookup_out(device, out, gpu);
    return rc == NVML_SUCCESS && *(const unsigned int *)out != version ? NVML_ERROR_ARGUMENT_VERSION_MISMATCH : rc;
}

/* A query answered from the GPU's index g alone, once the handle and the
 * output pointer have been checked. */
#define NVML_GPU_QUERY(name, type, out, answer)                   \
    NVML_EXPORT nvmlReturn_t name(nvmlDevice_t device, type *out) \
    {                                                             \
        unsigned int g;                                           \
        nvmlReturn_t rc = lookup_out(device, out, &g);            \
        if (rc == NVML_SUCCESS)                                   \
            answer;                                               \
        return rc;                                                \
    }

/* NVML_GPU_QUERY for a query that answers through two pointers. */
#define NVML_GPU_QUERY2(name, type, out1, out2, answer)                            \
    NVML_EXPORT nvmlReturn_t name(nvmlDevice_t device, type *out1, type *out2)     \
    {                                                                              \
        unsigned int g;                                                            \
        nvmlReturn_t rc = lookup_out_args(device, out1, &g, out2 == NULL);         \
        if (rc == NVML_SUCCESS)                                                    \
            answer;                                                                \
        return rc;                                                                 \
    }

nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (n >= length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

void reap_dead(void)
{
    sim_reap_dead(&g_sim);
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, g_cfg.driver_version_str);
}

/* Real NVML answers the version queries below before nvmlInit: they read the
 * configuration file while the state is not attached. */
static const struct sim_config *system_config(struct sim_config *buf)
{
    char err[256];
    if (atomic_load(&g_attached))
        return &g_cfg;
    return sim_config_load(getenv(SIM_ENV_CONFIG), buf, err, sizeof(err)) == 0 ? buf : NULL;
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    struct sim_config buf;
    const struct sim_config *cfg = system_config(&buf);
    if (cfg == NULL)
        return NVML_ERROR_UNKNOWN;
    /* As real NVML: CUDA major, then the driver version ("13.580.65.06"). */
    char text[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    snprintf(text, sizeof(text), "%u.%.31s", cfg->driver_version / 1000, cfg->driver_version_str);
    return copy_string(version, length, text);
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    struct sim_config buf;
    const struct sim_config *cfg = system_config(&buf);
    if (cudaDriverVersion == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (cfg == NULL)
        return NVML_ERROR_UNKNOWN;
    *cudaDriverVersion = (int)cfg->driver_version;
    return NVML_SUCCESS;
}

NVML_ALIAS(nvmlSystemGetCudaDriverVersion_v2, nvmlSystemGetCudaDriverVersion, (int *cudaDriverVersion))

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (deviceCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = g_cfg.gpu_count;
    return NVML_SUCCESS;
}

NVML_ALIAS(nvmlDeviceGetCount, nvmlDeviceGetCount_v2, (unsigned int *deviceCount))

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= g_cfg.gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    return give_handle(index, device);
}

NVML_ALIAS(nvmlDeviceGetHandleByIndex, nvmlDeviceGetHandleByIndex_v2, (unsigned int index, nvmlDevice_t *device))

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* MIG devices too: their UUIDs are unique across GPUs and MIG devices. */
    for (unsigned int i = 0; i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config v;
        if ((i < g_cfg.gpu_count || (dev_view(i, &v) && sim_mig_is_device(&v))) &&
            strcmp(uuid, i < g_cfg.gpu_count ? g_cfg.gpu[i].uuid : v.uuid) == 0)
            return give_handle(i, device);
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Hex "domain:bus:device.function", "domain:bus:device" or
 * "bus:device.function", the forms real NVML accepts. */
static bool parse_bus_id(const char *s, unsigned long *domain, unsigned long *bus, unsigned long *dev,
                         unsigned long *fn)
{
    unsigned long v[4];
    char sep[4];
    int n = 0;
    for (;;) {
        char *end;
        if (n == 4 || !isxdigit((unsigned char)*s))
            return false;
        errno = 0;
        v[n] = strtoul(s, &end, 16);
        if (errno || v[n] > 0xFFFFFFFFul)
            return false;
        s = end;
        sep[n++] = *s;
        if (*s++ == '\0')
            break;
    }
    if (n == 4 && sep[0] == ':' && sep[1] == ':' && sep[2] == '.') {
        *domain = v[0], *bus = v[1], *dev = v[2], *fn = v[3];
        return true;
    }
    if (n == 3 && sep[0] == ':' && sep[1] == ':') {
        *domain = v[0], *bus = v[1], *dev = v[2], *fn = 0;
        return true;
    }
    if (n == 3 && sep[0] == ':' && sep[1] == '.') {
        *domain = 0, *bus = v[0], *dev = v[1], *fn = v[2];
        return true;
    }
    return false;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    unsigned long domain, bus, dev, fn;
    if (pciBusId == NULL || device == NULL || !parse_bus_id(pciBusId, &domain, &bus, &dev, &fn))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < g_cfg.gpu_count && fn == 0; i++) {
        const struct sim_gpu_config *g = &g_cfg.gpu[i];
        if (g->pci_domain == domain && g->pci_bus == bus && g->pci_device == dev)
            return give_handle(i, device);
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_ALIAS(nvmlDeviceGetHandleByPciBusId, nvmlDeviceGetHandleByPciBusId_v2,
           (const char *pciBusId, nvmlDevice_t *device))

NVML_GPU_QUERY(nvmlDeviceGetIndex, unsigned int, index, *index = g)

NVML_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    unsigned int g;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_any(device, &g, &v);
    return rc != NVML_SUCCESS ? rc : copy_string(name, length, v.name);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    unsigned int g;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_any(device, &g, &v);
    return rc != NVML_SUCCESS ? rc : copy_string(uuid, length, v.uuid);
}

/* Fills the fields the pre-9.0 struct shares with nvmlPciInfo_t. */
static void fill_pci_legacy(nvmlPciInfo_t *pci, unsigned int gpu)
{
    const struct sim_gpu_config *g = &g_cfg.gpu[gpu];
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             g->pci_domain & 0xFFFFu, g->pci_bus & 0xFFu, g->pci_device & 0x1Fu);
    pci->domain = g->pci_domain;
    pci->bus = g->pci_bus;
    pci->device = g->pci_device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = 0;
}

static void fill_pci(nvmlPciInfo_t *pci, unsigned int gpu)
{
    fill_pci_legacy(pci, gpu);
    snprintf(pci->busId, sizeof(pci->busId), "%s", g_cfg.gpu[gpu].pci_bus_id);
}

/* Callers of the legacy entry points may hold the 52-byte pre-9.0 struct:
 * writing busId would run past it. */
NVML_GPU_QUERY(nvmlDeviceGetPciInfo, nvmlPciInfo_t, pci, fill_pci_legacy(pci, g))

NVML_ALIAS(nvmlDeviceGetPciInfo_v2, nvmlDeviceGetPciInfo, (nvmlDevice_t device, nvmlPciInfo_t *pci))

NVML_GPU_QUERY(nvmlDeviceGetPciInfo_v3, nvmlPciInfo_t, pci, fill_pci(pci, g))

NVML_GPU_QUERY(nvmlDeviceGetMinorNumber, unsigned int, minorNumber, *minorNumber = g_cfg.gpu[g].minor_number)

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    unsigned int g;
    nvmlReturn_t rc = lookup(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (major == NULL || minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = (int)g_cfg.gpu[g].cc_major;
    *minor = (int)g_cfg.gpu[g].cc_minor;
    return NVML_SUCCESS;
}

NVML_GPU_QUERY(nvmlDeviceGetMultiGpuBoard, unsigned int, multiGpuBool, *multiGpuBool = 0)

/* Used bytes, never above total: a transiently inconsistent counter must not
 * show as 17592186044134 MiB free. */
static unsigned long long used_bytes(unsigned int gpu, unsigned long long total)
{
    unsigned long long used = mig_used_bytes(gpu);
    return used < total ? used : total;
}

/* Device g's memory, once the processes that died have given theirs back. */
static nvmlMemory_t memory_of(unsigned int g, unsigned long long total)
{
    reap_dead();
    nvmlMemory_t m = {.total = total, .used = used_bytes(g, total)};
    m.free = m.total - m.used;
    return m;
}

/* A MIG device's handle answers for the instance's own memory. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    unsigned int g;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_any(device, &g, &v);
    if (rc != NVML_SUCCESS)
        return rc;
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *memory = memory_of(g, v.total_mem);
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    unsigned int g;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_any(device, &g, &v);
    if (rc == NVML_SUCCESS && memory == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && memory->version != nvmlMemory_v2)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc != NVML_SUCCESS)
        return rc;
    nvmlMemory_t m = memory_of(g, v.total_mem);
    /* reserved 0: the simulated driver keeps no memory for itself */
    *memory = (nvmlMemory_v2_t){.version = nvmlMemory_v2, .total = m.total, .free = m.free, .used = m.used};
    return NVML_SUCCESS;
}

static unsigned int percent(unsigned long long part, unsigned long long whole)
{
    if (whole == 0)
        return 0;
    double p = 100.0 * (double)part / (double)whole + 0.5;
    return p >= 100.0 ? 100u : (unsigned int)p;
}

/* Percent of the last UTIL_WINDOW_NS that GPU g ran a kernel. */
static unsigned int busy_percent(unsigned int g)
{
    uint64_t now = sim_now_ns(), from = now > UTIL_WINDOW_NS ? now - UTIL_WINDOW_NS : 0, busy;
    /* An incomplete history only undercounts: report what is known. */
    (void)sim_busy_between(g_sim.st, (int)g, from, now, &busy, NULL, 0, NULL);
    return percent(busy, now - from);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out(device, utilization, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    utilization->gpu = busy_percent(g);
    /* The simulation has no memory bandwidth: report occupancy instead. */
    utilization->memory = percent(used_bytes(g, g_cfg.gpu[g].total_mem), g_cfg.gpu[g].total_mem);
    return NVML_SUCCESS;
}

/* ---- what a monitoring tool shows ------------------------------------------
 *
 * The simulation has no fans, sensors, clocks or PCIe link. A data-centre GPU
 * in a server is what it imitates, so these answer as one does: the figures
 * are an H100 SXM5's (700 W board limit, 200 W its lowest setting, SM clock
 * 1980 MHz boost and 345 MHz idle, HBM3 at 2619 MHz, PCIe Gen5 x16), whatever
 * name the configuration gives the GPU. Temperature and power follow the
 * GPU's utilisation linearly between idle and full load, so a busy GPU looks
 * busy. A GPU cooled by the server's fans has none of its own: the fan
 * queries stay NOT_SUPPORTED (nvml_unmodelled.def), as on real SXM boards,
 * and nvmlDeviceGetDriverModel is Windows-only. */
#define SIM_POWER_LIMIT_MW 700000u
#define SIM_POWER_MIN_LIMIT_MW 200000u
#define SIM_POWER_IDLE_MW 70000u
#define SIM_TEMP_IDLE_C 32u
#define SIM_TEMP_FULL_LOAD_C 72u
#define SIM_CLOCK_SM_MAX_MHZ 1980u
#define SIM_CLOCK_SM_IDLE_MHZ 345u
#define SIM_CLOCK_MEM_MHZ 2619u
#define SIM_CLOCK_VIDEO_MAX_MHZ 1755u
#define SIM_CLOCK_VIDEO_IDLE_MHZ 765u
#define SIM_PCIE_GEN 5u
#define SIM_PCIE_WIDTH 16u
/* The sampling period real drivers report for encoder/decoder utilisation. */
#define SIM_CODEC_SAMPLE_US 167000u

/* Default until someone sets it (it is the GPU's, shared by every process;
 * a new simulated machine starts Default, as a GPU after a reboot). */
NVML_GPU_QUERY(nvmlDeviceGetComputeMode, nvmlComputeMode_t, mode,
               *mode = (nvmlComputeMode_t)atomic_load(&g_sim.st->gpu[g].compute_mode))

/* Root only, as NVIDIA documents; takes effect at once for new contexts.
 * EXCLUSIVE_THREAD is no longer a mode CUDA has. */
NVML_EXPORT nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode)
{
    unsigned int g;
    nvmlReturn_t rc = lookup(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((unsigned)mode >= NVML_COMPUTEMODE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mode == NVML_COMPUTEMODE_EXCLUSIVE_THREAD)
        return NVML_ERROR_NOT_SUPPORTED;
    if (geteuid() != 0)
        return NVML_ERROR_NO_PERMISSION;
    atomic_store(&g_sim.st->gpu[g].compute_mode, (uint32_t)mode);
    return NVML_SUCCESS;
}
/* Servers run nvidia-persistenced and drive no display. */
NVML_GPU_QUERY(nvmlDeviceGetPersistenceMode, nvmlEnableState_t, mode, *mode = NVML_FEATURE_ENABLED)
NVML_GPU_QUERY(nvmlDeviceGetDisplayMode, nvmlEnableState_t, display, *display = NVML_FEATURE_DISABLED)
NVML_GPU_QUERY(nvmlDeviceGetDisplayActive, nvmlEnableState_t, isActive, *isActive = NVML_FEATURE_DISABLED)
/* With persistence on, a data-centre GPU stays in P0 and idles by clock. */
NVML_GPU_QUERY(nvmlDeviceGetPerformanceState, nvmlPstates_t, pState, *pState = NVML_PSTATE_0)
NVML_GPU_QUERY(nvmlDeviceGetPowerManagementMode, nvmlEnableState_t, mode, *mode = NVML_FEATURE_ENABLED)
NVML_GPU_QUERY(nvmlDeviceGetPowerManagementLimit, unsigned int, limit, *limit = SIM_POWER_LIMIT_MW)
NVML_GPU_QUERY(nvmlDeviceGetPowerManagementDefaultLimit, unsigned int, defaultLimit, *defaultLimit = SIM_POWER_LIMIT_MW)
NVML_GPU_QUERY(nvmlDeviceGetEnforcedPowerLimit, unsigned int, limit, *limit = SIM_POWER_LIMIT_MW)
NVML_GPU_QUERY(nvmlDeviceGetPowerUsage, unsigned int, power,
               *power = SIM_POWER_IDLE_MW + (SIM_POWER_LIMIT_MW - SIM_POWER_IDLE_MW) / 100u * busy_percent(g))
NVML_GPU_QUERY(nvmlDeviceGetCurrPcieLinkGeneration, unsigned int, currLinkGen, *currLinkGen = SIM_PCIE_GEN)
NVML_GPU_QUERY(nvmlDeviceGetMaxPcieLinkGeneration, unsigned int, maxLinkGen, *maxLinkGen = SIM_PCIE_GEN)
NVML_GPU_QUERY(nvmlDeviceGetCurrPcieLinkWidth, unsigned int, currLinkWidth, *currLinkWidth = SIM_PCIE_WIDTH)
NVML_GPU_QUERY(nvmlDeviceGetMaxPcieLinkWidth, unsigned int, maxLinkWidth, *maxLinkWidth = SIM_PCIE_WIDTH)
/* A GPU handle is never a MIG device: the simulation has no MIG. */

NVML_GPU_QUERY2(nvmlDeviceGetPowerManagementLimitConstraints, unsigned int, minLimit, maxLimit,
                (*minLimit = SIM_POWER_MIN_LIMIT_MW, *maxLimit = SIM_POWER_LIMIT_MW))

static unsigned int temperature(unsigned int g)
{
    return SIM_TEMP_IDLE_C + (SIM_TEMP_FULL_LOAD_C - SIM_TEMP_IDLE_C) * busy_percent(g) / 100u;
}

/* The die's one reading stands for its hottest part too. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType,
                                                  unsigned int *temp)
{
    unsigned int g;
    nvmlReturn_t rc =
        lookup_out_args(device, temp, &g, (unsigned int)sensorType >= (unsigned int)NVML_TEMPERATURE_COUNT);
    if (rc != NVML_SUCCESS)
        return rc;
    *temp = temperature(g);
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temp)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_versioned(device, temp, nvmlTemperature_v1, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((unsigned int)temp->sensorType >= (unsigned int)NVML_TEMPERATURE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    temp->temperature = (int)temperature(g);
    return NVML_SUCCESS;
}

/* Clocks run at boost while a kernel ran in the last window, else idle;
 * the memory clock never drops in P0. */
static nvmlReturn_t clock_query(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock, bool max)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out(device, clock, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    bool boost = max || busy_percent(g) > 0;
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: *clock = boost ? SIM_CLOCK_SM_MAX_MHZ : SIM_CLOCK_SM_IDLE_MHZ; break;
    case NVML_CLOCK_MEM: *clock = SIM_CLOCK_MEM_MHZ; break;
    case NVML_CLOCK_VIDEO: *clock = boost ? SIM_CLOCK_VIDEO_MAX_MHZ : SIM_CLOCK_VIDEO_IDLE_MHZ; break;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    return clock_query(device, type, clock, false);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    return clock_query(device, type, clock, true);
}

/* The simulation runs no video codecs: idle engines, over a real period. */
static nvmlReturn_t codec_utilization(nvmlDevice_t device, unsigned int *utilization, unsigned int *samplingPeriodUs)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out_args(device, utilization, &g, samplingPeriodUs == NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    *utilization = 0;
    *samplingPeriodUs = SIM_CODEC_SAMPLE_US;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                         unsigned int *samplingPeriodUs)
{
    return codec_utilization(device, utilization, samplingPeriodUs);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                         unsigned int *samplingPeriodUs)
{
    return codec_utilization(device, utilization, samplingPeriodUs);
}

/* ECC on, as data-centre GPUs ship; simulated memory never flips a bit. */
NVML_GPU_QUERY2(nvmlDeviceGetEccMode, nvmlEnableState_t, current, pending, *current = *pending = NVML_FEATURE_ENABLED)

NVML_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                                     nvmlEccCounterType_t counterType, unsigned long long *eccCounts)
{
    unsigned int g;
    bool bad = (unsigned int)errorType >= (unsigned int)NVML_MEMORY_ERROR_TYPE_COUNT ||
               (unsigned int)counterType >= (unsigned int)NVML_ECC_COUNTER_TYPE_COUNT;
    nvmlReturn_t rc = lookup_out_args(device, eccCounts, &g, bad);
    if (rc != NVML_SUCCESS)
        return rc;
    *eccCounts = 0;
    return NVML_SUCCESS;
}

/* Copies between host and simulated device memory are plain memcpy: nothing
 * crosses a bus. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, nvmlPcieUtilCounter_t counter,
                                                     unsigned int *value)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out_args(device, value, &g, (unsigned int)counter >= (unsigned int)NVML_PCIE_UTIL_COUNT);
    if (rc != NVML_SUCCESS)
        return rc;
    *value = 0;
    return NVML_SUCCESS;
}

/* BAR1 is the device memory's size rounded up to a power of two, as on the
 * A100 40GB (64 GiB) and H100 80GB (128 GiB); the simulation maps nothing
 * through it. A MIG device answers for its share of its GPU's BAR1 by
 * memory slices (the simulation's reading: tools such as nvitop show it). */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory)
{
    unsigned int g;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_any(device, &g, &v);
    if (rc == NVML_SUCCESS && bar1Memory == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int gpu = g < g_cfg.gpu_count ? g : v.mig_parent - 1;
    unsigned long long total = 1;
    while (total < g_cfg.gpu[gpu].total_mem && total < (1ULL << 62))
        total <<= 1;
    const struct sim_mig_profile *p = g < g_cfg.gpu_count ? NULL : sim_mig_by_index(v.mig_profile);
    if (p != NULL)
        total = total / SIM_MIG_MEMORY_SLICES * p->memory_slices;
    *bar1Memory = (nvmlBAR1Memory_t){.bar1Total = total, .bar1Free = total, .bar1Used = 0};
    return NVML_SUCCESS;
}

struct proc_view {
    unsigned int pid;
    unsigned int gi, ci;          /* the MIG instance it runs in; NO_MIG_INSTANCE outside MIG */
    unsigned long long used;
    int slot;
    uint64_t generation;
};

/* Pids of processes of other pid namespaces, as sim_slot_pid found them, by
 * (slot, generation): a process's pid never changes, and the /proc search
 * for one that dropped its pid lock costs ~150 µs a process at each query. */
static pthread_mutex_t g_pid_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uint64_t generation, self_ns;
    int32_t pid;
} g_pid_cache[SIM_MAX_PROCS];

static int32_t cached_pid(int i, uint64_t gen, uint64_t self_ns)
{
    int32_t pid = -1;
    pthread_mutex_lock(&g_pid_lock);
    if (g_pid_cache[i].generation == gen && g_pid_cache[i].self_ns == self_ns)
        pid = g_pid_cache[i].pid;
    pthread_mutex_unlock(&g_pid_lock);
    return pid;
}

static void cache_pid(int i, uint64_t gen, uint64_t self_ns, int32_t pid)
{
    pthread_mutex_lock(&g_pid_lock);
    g_pid_cache[i].generation = gen;
    g_pid_cache[i].self_ns = self_ns;
    g_pid_cache[i].pid = pid;
    pthread_mutex_unlock(&g_pid_lock);
}

/* A consistent view of one slot, or false if it is not a live process on
 * `gpu` (a process is on a GPU once it has a context there or holds memory
 * there) or not visible from the caller's pid namespace (`self_ns`), which
 * newer drivers leave out too. The generation check rejects a slot
 * re-claimed while read, and with it a pid translated for its new owner. */
static bool read_slot(int i, unsigned int gpu, uint64_t self_ns, struct proc_view *v)
{
    const struct sim_proc_slot *s = &g_sim.st->proc[i];
    uint64_t gen = atomic_load(&s->generation);
    if (atomic_load(&s->state) != SIM_SLOT_LIVE)
        return false;
    v->used = atomic_load(&s->used[gpu]);
    uint32_t mask = atomic_load(&s->gpu_mask);
    if (!((mask >> gpu) & 1u) && v->used == 0)
        return false;
    int32_t pid = cached_pid(i, gen, self_ns);
    bool cached = pid >= 0;
    if (!cached)
        pid = sim_slot_pid(&g_sim, i, self_ns);
    if (atomic_load(&s->state) != SIM_SLOT_LIVE || atomic_load(&s->generation) != gen)
        return false;
    if (!cached)
        cache_pid(i, gen, self_ns, pid); /* 0 too: a process never becomes visible */
    v->pid = (unsigned int)pid;
    v->gi = v->ci = NO_MIG_INSTANCE;
    v->slot = i;
    v->generation = gen;
    return pid != 0;
}

/* Which processes a list names: every process with a context on the GPU
 * (an MPS server and, since each has a context of its own, its clients),
 * only the MPS clients of live servers, or none (graphics). */
enum proc_list { PROCS_COMPUTE, PROCS_MPS, PROCS_NONE };

static unsigned int live_procs_of(unsigned int gpu, struct proc_view *out, enum proc_list which)
{
    unsigned int n = 0;
    if (which == PROCS_NONE)
        return 0;
    uint64_t self_ns = sim_pidns_self();
    reap_dead();
    for (int i = 0; i < SIM_MAX_PROCS; i++)
        if ((which != PROCS_MPS || sim_mps_client_live(g_sim.st, i)) && read_slot(i, gpu, self_ns, &out[n]))
            n++;
    return n;
}

static unsigned int live_procs(unsigned int gpu, struct proc_view *out)
{
    return live_procs_of(gpu, out, PROCS_COMPUTE);
}

/* A GPU in MIG mode lists the processes of its MIG devices, each with its
 * GPU and compute instance ids, as a real driver lists them to root. A
 * process holds one MIG device at most (CUDA enumerates one). */
static unsigned int mig_procs(unsigned int gpu, struct proc_view *out)
{
    unsigned int n = 0;
    for (unsigned int d = g_cfg.gpu_count; d < SIM_MAX_GPUS; d++) {
        struct sim_gpu_config m;
        if (!dev_view(d, &m) || !sim_mig_is_device(&m) || m.mig_parent != gpu + 1)
            continue;
        struct proc_view found[SIM_MAX_PROCS];
        unsigned int k = live_procs(d, found);
        for (unsigned int i = 0; i < k && n < SIM_MAX_PROCS; i++, n++) {
            out[n] = found[i];
            out[n].gi = m.gi_id;
            out[n].ci = m.ci_id;
        }
    }
    return n;
}

enum info_layout { INFO_V1, INFO_V2, INFO_V3 };

/* The count protocol of every NVML list query: *count in is the room in
 * `infos`; too little room (a NULL `infos` with room 0 asks for the size)
 * gives NVML_ERROR_INSUFFICIENT_SIZE and the count needed. */
static nvmlReturn_t list_procs(nvmlDevice_t device, unsigned int *infoCount, void *infos, enum info_layout layout,
                               enum proc_list which)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out(device, infoCount, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    struct proc_view procs[SIM_MAX_PROCS];
    /* No MPS on a GPU in MIG mode here: its compute list is its MIG devices'. */
    bool mig = sim_mig_load(&g_sim.st->config.gpu[g].mig_mode);
    unsigned int n = mig ? (which == PROCS_COMPUTE ? mig_procs(g, procs) : 0) : live_procs_of(g, procs, which);
    if (*infoCount < n) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (infos == NULL && n > 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < n; i++) {
        if (layout == INFO_V1)
            ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){procs[i].pid, procs[i].used};
        else if (layout == INFO_V2)
            ((nvmlProcessInfo_v2_t *)infos)[i] =
                (nvmlProcessInfo_v2_t){procs[i].pid, procs[i].used, procs[i].gi, procs[i].ci};
        else
            ((nvmlProcessInfo_t *)infos)[i] = (nvmlProcessInfo_t){procs[i].pid, procs[i].used, procs[i].gi, procs[i].ci};
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

/* One definition per exported name and struct version, and the processes
 * it lists (the simulation has no graphics contexts). */
#define RUNNING_PROCESSES(symbol, info_t, layout, which)                                    \
    NVML_EXPORT nvmlReturn_t symbol(nvmlDevice_t device, unsigned int *infoCount, info_t *infos) \
    {                                                                                        \
        return list_procs(device, infoCount, infos, layout, which);                          \
    }
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, INFO_V1, PROCS_COMPUTE)
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, INFO_V2, PROCS_COMPUTE)
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t, INFO_V3, PROCS_COMPUTE)
RUNNING_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t, INFO_V1, PROCS_NONE)
RUNNING_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t, INFO_V2, PROCS_NONE)
RUNNING_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t, INFO_V3, PROCS_NONE)
RUNNING_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t, INFO_V1, PROCS_MPS)
RUNNING_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, INFO_V2, PROCS_MPS)
RUNNING_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t, INFO_V3, PROCS_MPS)

/* The same processes in one versioned call per mode. nvml.h documents a bad
 * version or mode as INVALID_ARGUMENT here, not ARGUMENT_VERSION_MISMATCH.
 * No confidential computing: no protected memory. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out(device, plist, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (plist->version != nvmlProcessDetailList_v1 || plist->mode >= NVML_PROCESS_MODE_MAX)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct proc_view procs[SIM_MAX_PROCS];
    bool compute = plist->mode == NVML_PROCESS_MODE_COMPUTE || plist->mode == NVML_PROCESS_MODE_ALL;
    enum proc_list which = compute ? PROCS_COMPUTE : plist->mode == NVML_PROCESS_MODE_MPS ? PROCS_MPS : PROCS_NONE;
    unsigned int n = live_procs_of(g, procs, which);
    if (plist->numProcArrayEntries < n || (n > 0 && plist->procArray == NULL)) {
        plist->numProcArrayEntries = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++)
        plist->procArray[i] = (nvmlProcessDetail_v1_t){procs[i].pid, procs[i].used, NO_MIG_INSTANCE, NO_MIG_INSTANCE, 0};
    plist->numProcArrayEntries = n;
    return NVML_SUCCESS;
}

static uint64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* One sample per live process that ran on the GPU after lastSeenTimeStamp
 * (microseconds of CLOCK_REALTIME, as real NVML stamps samples), over at most
 * the last UTIL_WINDOW_NS, into samples[]: their count; 0 means
 * NVML_ERROR_NOT_FOUND, as the real driver answers when it has no newer
 * sample. Time is matched to processes by (slot, generation), so two
 * processes sharing a pid in different namespaces stay two. */
static unsigned int util_samples(unsigned int g, unsigned long long lastSeenTimeStamp,
                                 nvmlProcessUtilizationSample_t *samples)
{
    uint64_t mono = sim_now_ns(), real = realtime_ns();
    uint64_t now_us = real / 1000, window = UTIL_WINDOW_NS;
    if (lastSeenTimeStamp >= now_us)
        return 0;
    /* Both clocks tick together: the window's length is the same on each. */
    if ((now_us - lastSeenTimeStamp) * 1000 < window)
        window = (now_us - lastSeenTimeStamp) * 1000;
    uint64_t from = mono > window ? mono - window : 0;

    struct proc_view procs[SIM_MAX_PROCS];
    struct sim_pid_busy busy[SIM_MAX_PROCS];
    uint64_t total;
    int nbusy;
    unsigned int n = 0, nprocs = live_procs(g, procs);
    (void)sim_busy_between(g_sim.st, (int)g, from, mono, &total, busy, SIM_MAX_PROCS, &nbusy);
    for (unsigned int i = 0; i < nprocs; i++) {
        for (int j = 0; j < nbusy; j++) {
            if ((int)busy[j].slot == procs[i].slot && busy[j].generation == procs[i].generation)
                samples[n++] = (nvmlProcessUtilizationSample_t){
                    .pid = procs[i].pid, .timeStamp = now_us, .smUtil = percent(busy[j].ns, mono - from)};
        }
    }
    return n;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                         nvmlProcessUtilizationSample_t *utilization,
                                                         unsigned int *processSamplesCount,
                                                         unsigned long long lastSeenTimeStamp)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out(device, processSamplesCount, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    nvmlProcessUtilizationSample_t samples[SIM_MAX_PROCS];
    unsigned int n = util_samples(g, lastSeenTimeStamp, samples);
    if (n == 0) {
        *processSamplesCount = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (utilization == NULL || *processSamplesCount < n) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(utilization, samples, n * sizeof(samples[0]));
    *processSamplesCount = n;
    return NVML_SUCCESS;
}

/* The same samples in the newer, versioned layout. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                               nvmlProcessesUtilizationInfo_t *procesesUtilInfo)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_versioned(device, procesesUtilInfo, nvmlProcessesUtilizationInfo_v1, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    nvmlProcessesUtilizationInfo_t *info = procesesUtilInfo;
    nvmlProcessUtilizationSample_t samples[SIM_MAX_PROCS];
    unsigned int n = util_samples(g, info->lastSeenTimeStamp, samples);
    if (n == 0) {
        info->processSamplesCount = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (info->procUtilArray == NULL || info->processSamplesCount < n) {
        info->processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++)
        info->procUtilArray[i] = (nvmlProcessUtilizationInfo_v1_t){
            .timeStamp = samples[i].timeStamp, .pid = samples[i].pid, .smUtil = samples[i].smUtil};
    info->processSamplesCount = n;
    return NVML_SUCCESS;
}

/* lookup_out() for a query about a pair of GPUs. */
static nvmlReturn_t lookup_pair(nvmlDevice_t device1, nvmlDevice_t device2, const void *out, unsigned int *a,
                                unsigned int *b)
{
    nvmlReturn_t rc = lookup(device1, a);
    return rc == NVML_SUCCESS ? lookup_out(device2, out, b) : rc;
}

/* The PCIe path between two GPUs from the config's switch, bridge and socket
 * (each 0 when unset): GPUs placed nowhere are the most distant, SYSTEM. */
static nvmlGpuTopologyLevel_t topology_level(unsigned int a, unsigned int b)
{
    const struct sim_gpu_config *x = &g_cfg.gpu[a], *y = &g_cfg.gpu[b];
    if (a == b)
        return NVML_TOPOLOGY_INTERNAL;
    if (x->pcie_switch && x->pcie_switch == y->pcie_switch)
        return NVML_TOPOLOGY_SINGLE;
    if (x->host_bridge && x->host_bridge == y->host_bridge)
        return NVML_TOPOLOGY_HOSTBRIDGE;
    if (x->cpu_socket && x->cpu_socket == y->cpu_socket)
        return NVML_TOPOLOGY_NODE;
    return NVML_TOPOLOGY_SYSTEM;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                             nvmlGpuTopologyLevel_t *pathInfo)
{
    unsigned int a, b;
    nvmlReturn_t rc = lookup_pair(device1, device2, pathInfo, &a, &b);
    if (rc == NVML_SUCCESS)
        *pathInfo = topology_level(a, b);
    return rc;
}

/* The other GPUs at `level` or nearer. With *count 0 only the number is
 * given; a smaller *count than that is INSUFFICIENT_SIZE, with the number. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level,
                                                          unsigned int *count, nvmlDevice_t *deviceArray)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out(device, count, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((unsigned int)level > (unsigned int)NVML_TOPOLOGY_SYSTEM || (*count > 0 && deviceArray == NULL))
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int found = 0;
    for (unsigned int i = 0; i < g_cfg.gpu_count; i++)
        if (i != g && topology_level(g, i) <= level)
            found++;
    if (*count == 0 || *count < found) {
        bool asked = *count != 0;
        *count = found;
        return asked ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    unsigned int n = 0;
    for (unsigned int i = 0; i < g_cfg.gpu_count; i++)
        if (i != g && topology_level(g, i) <= level)
            deviceArray[n++] = &g_dev[i];
    *count = n;
    return NVML_SUCCESS;
}

/* NVLink peers of a GPU among the GPUs that exist. A link joins two GPUs, so
 * a link named on either side's config line counts for both. */
static uint32_t nvlink_peers(unsigned int gpu)
{
    uint32_t peers = g_cfg.gpu[gpu].nvlink_peers;
    for (unsigned int i = 0; i < g_cfg.gpu_count; i++)
        if ((g_cfg.gpu[i].nvlink_peers >> gpu) & 1u)
            peers |= 1u << i;
    uint32_t exists = g_cfg.gpu_count >= 32 ? UINT32_MAX : (1u << g_cfg.gpu_count) - 1u;
    return peers & exists & ~(1u << gpu);
}

/* How many links join two linked GPUs: the larger count either side names. */
static unsigned int nvlink_count(unsigned int a, unsigned int b)
{
    unsigned int x = (g_cfg.gpu[a].nvlink_peers >> b) & 1u ? g_cfg.gpu[a].nvlink_links[b] : 0;
    unsigned int y = (g_cfg.gpu[b].nvlink_peers >> a) & 1u ? g_cfg.gpu[b].nvlink_links[a] : 0;
    unsigned int n = x > y ? x : y;
    return n ? n : 1;
}

/* GPUs with NVSwitch links all reach each other through the fabric, whose
 * switches (SIM_NVSWITCHES of them) take a GPU's links in turn. */
#define SIM_NVSWITCHES 4
#define LINK_TO_SWITCH 1000 /* link_peer's answer for a link to switch s: LINK_TO_SWITCH + s */

static bool in_fabric(unsigned int a, unsigned int b)
{
    return a != b && g_cfg.gpu[a].nvswitch_links && g_cfg.gpu[b].nvswitch_links;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                                nvmlGpuP2PCapsIndex_t p2pIndex, nvmlGpuP2PStatus_t *p2pStatus)
{
    unsigned int a, b;
    nvmlReturn_t rc = lookup_pair(device1, device2, p2pStatus, &a, &b);
    if (rc != NVML_SUCCESS)
        return rc;
    if ((unsigned int)p2pIndex >= (unsigned int)NVML_P2P_CAPS_INDEX_UNKNOWN)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* Peer access runs over NVLink only, as cuDeviceCanAccessPeer says (the
     * PCIe tree above places GPUs; the simulation models no PCIe P2P); a GPU
     * is not its own peer. */
    bool linked = a != b && (((nvlink_peers(a) >> b) & 1u) || in_fabric(a, b));
    *p2pStatus = linked && p2pIndex != NVML_P2P_CAPS_INDEX_PCI ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

/* The links of a GPU lead to its NVLink peers in index order, each peer's
 * links one after another, then to the NVSwitches. Returns the
 * peer, -1 for a link that exists but is down, or an error through *rc:
 * INVALID_ARGUMENT, once the link is known, for a NULL `out` or `bad_args`. */
static int link_peer(nvmlDevice_t device, unsigned int link, const void *out, bool bad_args, nvmlReturn_t *rc)
{
    unsigned int g;
    *rc = lookup(device, &g);
    if (*rc != NVML_SUCCESS)
        return -1;
    if (link >= NVML_NVLINK_MAX_LINKS) {
        *rc = NVML_ERROR_INVALID_ARGUMENT;
        return -1;
    }
    uint32_t peers = nvlink_peers(g);
    if (peers == 0 && g_cfg.gpu[g].nvswitch_links == 0) {
        *rc = NVML_ERROR_NOT_SUPPORTED; /* a GPU without NVLink */
        return -1;
    }
    if (out == NULL || bad_args) {
        *rc = NVML_ERROR_INVALID_ARGUMENT;
        return -1;
    }
    for (unsigned int i = 0; i < SIM_MAX_GPUS; i++) {
        if (!((peers >> i) & 1u))
            continue;
        unsigned int n = nvlink_count(g, i);
        if (link < n)
            return (int)i;
        link -= n;
    }
    if (link < g_cfg.gpu[g].nvswitch_links)
        return LINK_TO_SWITCH + (int)(link % SIM_NVSWITCHES);
    return -1;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    nvmlReturn_t rc;
    int peer = link_peer(device, link, isActive, false, &rc);
    if (rc != NVML_SUCCESS)
        return rc;
    *isActive = peer >= 0 ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkCapability(nvmlDevice_t device, unsigned int link,
                                                       nvmlNvLinkCapability_t capability, unsigned int *capResult)
{
    nvmlReturn_t rc;
    bool bad_capability = (unsigned int)capability >= (unsigned int)NVML_NVLINK_CAP_COUNT;
    int peer = link_peer(device, link, capResult, bad_capability, &rc);
    if (rc != NVML_SUCCESS)
        return rc;
    /* A link between two GPUs: peer access and peer atomics; with no CPU at
     * the other end, no system memory through it. */
    bool gpu_link = capability == NVML_NVLINK_CAP_P2P_SUPPORTED || capability == NVML_NVLINK_CAP_P2P_ATOMICS ||
                    capability == NVML_NVLINK_CAP_VALID;
    *capResult = peer >= 0 && gpu_link;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                             nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)
{
    nvmlReturn_t rc;
    int peer = link_peer(device, link, pNvLinkDeviceType, false, &rc);
    if (rc != NVML_SUCCESS)
        return rc;
    if (peer < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *pNvLinkDeviceType = peer >= LINK_TO_SWITCH ? NVML_NVLINK_DEVICE_TYPE_SWITCH : NVML_NVLINK_DEVICE_TYPE_GPU;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                             nvmlPciInfo_t *pci)
{
    nvmlReturn_t rc;
    int peer = link_peer(device, link, pci, false, &rc);
    if (rc != NVML_SUCCESS)
        return rc;
    if (peer < 0)
        return NVML_ERROR_NOT_SUPPORTED; /* nothing at the end of a link that is down */
    if (peer >= LINK_TO_SWITCH) { /* an NVSwitch: bridges of their own, after the GPUs' */
        unsigned int s = (unsigned int)(peer - LINK_TO_SWITCH);
        memset(pci, 0, sizeof(*pci));
        pci->bus = 0xc1u + s;
        pci->pciDeviceId = 0x22a310deu; /* NVSwitch (H100 systems) */
        snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, 0u, pci->bus & 0xFFu, 0u);
        snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:00.0", 0u, pci->bus);
        return NVML_SUCCESS;
    }
    fill_pci(pci, (unsigned int)peer);
    return NVML_SUCCESS;
}

/* ---- events ------------------------------------------------------------------
 *
 * The simulation raises one kind of event: XIDs, posted to a per-GPU ring in
 * the shared state (cgpu-sim-stat --xid, --lost). An event set remembers, per
 * GPU, the next XID it delivers, starting from the ones posted after it
 * registered: every set in every process sees each XID once. A set that
 * falls more than SIM_XID_RING behind skips the oldest, as a real driver's
 * event queue overflows. */

#define EVENT_SET_MAGIC 0x45565331u
/* What a data-centre GPU reports as supported; of these the simulation only
 * ever raises XIDs. */
#define SUPPORTED_EVENTS                                                                                  \
    ((unsigned long long)(nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError |               \
                          nvmlEventTypePState | nvmlEventTypeXidCriticalError | nvmlEventTypeClock))

struct nvmlEventSet_st {
    uint32_t magic;
    /* NVML is thread-safe: one thread may register while another waits. */
    pthread_mutex_t lock;
    unsigned long long types[SIM_MAX_GPUS];
    uint64_t next_xid[SIM_MAX_GPUS];
    unsigned int first_gpu; /* where the next scan starts: one noisy GPU cannot starve the rest */
};

static bool set_valid(const struct nvmlEventSet_st *set)
{
    return set != NULL && set->magic == EVENT_SET_MAGIC;
}

NVML_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (set == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NVML_ERROR_MEMORY;
    pthread_mutex_init(&s->lock, NULL);
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!set_valid(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    pthread_mutex_destroy(&set->lock);
    free(set);
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_out(device, eventTypes, &g);
    if (rc == NVML_SUCCESS)
        *eventTypes = SUPPORTED_EVENTS;
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                                  nvmlEventSet_t set)
{
    unsigned int g;
    nvmlReturn_t rc = lookup(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!set_valid(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~SUPPORTED_EVENTS)
        return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&set->lock);
    /* Registering again keeps the set's place: nothing is delivered twice. */
    if ((eventTypes & nvmlEventTypeXidCriticalError) && !(set->types[g] & nvmlEventTypeXidCriticalError))
        set->next_xid[g] = atomic_load(&g_sim.st->gpu[g].fault.xid_head);
    set->types[g] |= eventTypes;
    pthread_mutex_unlock(&set->lock);
    return NVML_SUCCESS;
}

/* The next XID for the set on GPU g, if one is published. Caller holds the
 * set's lock. */
static bool next_xid(struct nvmlEventSet_st *set, unsigned int g, uint64_t *xid)
{
    const struct sim_gpu_fault *f = &g_sim.st->gpu[g].fault;
    for (;;) {
        uint64_t head = atomic_load(&f->xid_head), *next = &set->next_xid[g];
        if (*next >= head)
            return false;
        if (head - *next > SIM_XID_RING)
            *next = head - SIM_XID_RING;
        int got = sim_xid_read(g_sim.st, (int)g, *next, xid);
        if (got == 0)
            return false; /* its poster is still writing it: the next wait gets it */
        (*next)++;
        if (got > 0)
            return true;
    }
}

/* One pass over the set: an event into *data (true), else whether a GPU of
 * the set is lost. */
static bool take_event(struct nvmlEventSet_st *set, nvmlEventData_t *data, bool *lost)
{
    bool found = false;
    *lost = false;
    pthread_mutex_lock(&set->lock);
    for (unsigned int k = 0; k < g_cfg.gpu_count && !found; k++) {
        unsigned int g = (set->first_gpu + k) % g_cfg.gpu_count;
        uint64_t xid;
        if (set->types[g] == 0)
            continue;
        if ((set->types[g] & nvmlEventTypeXidCriticalError) && next_xid(set, g, &xid)) {
            *data = (nvmlEventData_t){.device = &g_dev[g],
                                      .eventType = nvmlEventTypeXidCriticalError,
                                      .eventData = xid,
                                      .gpuInstanceId = NO_MIG_INSTANCE,
                                      .computeInstanceId = NO_MIG_INSTANCE};
            set->first_gpu = (g + 1) % g_cfg.gpu_count;
            found = true;
        }
        *lost = *lost || sim_gpu_lost(g_sim.st, (int)g);
    }
    pthread_mutex_unlock(&set->lock);
    return found;
}

/* Events already posted come first; then a lost GPU in the set makes the
 * wait fail with GPU_IS_LOST, as NVIDIA documents; else it sleeps until an
 * event or the timeout (ms). A signal ends the sleep with TIMEOUT, as the
 * real call returns early "when interrupt arrives". */
NVML_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    if (!set_valid(set) || data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = sim_now_ns() + (uint64_t)timeoutms * 1000000ULL;
    for (;;) {
        uint32_t epoch = atomic_load(&g_sim.st->fault_epoch);
        bool lost;
        if (take_event(set, data, &lost))
            return NVML_SUCCESS;
        if (lost)
            return NVML_ERROR_GPU_IS_LOST;
        uint64_t now = sim_now_ns();
        if (now >= deadline || sim_fault_wait(g_sim.st, epoch, deadline - now) != 0)
            return NVML_ERROR_TIMEOUT;
    }
}

NVML_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlEventData_t full;
    nvmlReturn_t rc = nvmlEventSetWait_v2(set, &full, timeoutms);
    if (rc == NVML_SUCCESS) /* the caller's struct may end before gpuInstanceId */
        memcpy(data, &full, offsetof(nvmlEventData_t, gpuInstanceId));
    return rc;
}
