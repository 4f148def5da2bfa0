/* Simulated libcuda.so.1: initialisation, errors, entry-point lookup,
 * devices and contexts. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "driver.h"
#include "driver_procs.h"
#include "simmig.h"

struct sim_driver sim_drv = {.lock = PTHREAD_MUTEX_INITIALIZER, .shared = {.fd = -1, .slot = -1}};

/* ---- initialisation ------------------------------------------------------ */

/* A forked child must not share the parent's slot lock or its handles:
 * like the real driver, it starts uninitialised. */
static void after_fork_child(void)
{
    pthread_mutex_init(&sim_drv.lock, NULL);
    if (atomic_load(&sim_drv.initialized)) {
        sim_detach(&sim_drv.shared);
        atomic_store(&sim_drv.initialized, 0);
    }
    memset(sim_drv.primary_refs, 0, sizeof(sim_drv.primary_refs));
    sim_forget_allocations();
    sim_mps_forget();
}

static void read_visible_devices(void);

static int fork_handler_rc;

static void install_fork_handler(void)
{
    fork_handler_rc = pthread_atfork(NULL, NULL, after_fork_child);
}

SIM_EXPORT CUresult cuInit(unsigned int Flags)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&once, install_fork_handler);
    if (fork_handler_rc != 0) { /* a forked child would share its parent's process slot */
        fprintf(stderr, "cgpu-sim: cannot register a fork handler: %s\n", strerror(fork_handler_rc));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (atomic_load(&sim_drv.initialized))
        return CUDA_SUCCESS;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&sim_drv.lock);
    if (!atomic_load(&sim_drv.initialized)) {
        char err[512];
        if (sim_attach(&sim_drv.shared, err, sizeof(err)) != 0) {
            fprintf(stderr, "cgpu-sim: %s\n", err);
            rc = CUDA_ERROR_NO_DEVICE;
        } else if (sim_claim_slot(&sim_drv.shared) != 0) {
            fprintf(stderr, "cgpu-sim: all %d process slots of the simulated GPUs are taken\n", SIM_MAX_PROCS);
            sim_detach(&sim_drv.shared);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            for (unsigned d = 0; d < SIM_MAX_GPUS; d++) {
                sim_drv.primary[d] = (struct sim_ctx){.magic = MAGIC_CTX, .dev = (int)d, .primary = true};
                sim_drv.primary[d].legacy = (struct sim_stream){.magic = MAGIC_STREAM, .ctx = &sim_drv.primary[d]};
                sim_drv.default_pool[d] = (struct sim_pool){.magic = MAGIC_POOL, .dev = (int)d};
                sim_drv.next_va[d] = SIM_VA_BASE(d);
            }
            read_visible_devices();
            rc = sim_mps_attach();
            if (rc != CUDA_SUCCESS) {
                sim_detach(&sim_drv.shared);
            } else {
                atomic_store(&sim_drv.initialized, 1);
                if (sim_drv.visible_count == 0)
                    rc = CUDA_ERROR_NO_DEVICE;
            }
        }
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

CUresult sim_check_init(void)
{
    return atomic_load_explicit(&sim_drv.initialized, memory_order_acquire) ? CUDA_SUCCESS
                                                                             : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_device(CUdevice dev, int *phys)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (dev < 0 || dev >= sim_drv.visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *phys = sim_drv.visible[dev];
    return CUDA_SUCCESS;
}

CUresult sim_check_init_args(bool bad_args)
{
    CUresult rc = sim_check_init();
    return rc ? rc : bad_args ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult sim_check_handle(const void *h, uint32_t magic, CUresult bad)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    return h && *(const uint32_t *)h == magic ? CUDA_SUCCESS : bad;
}

CUresult sim_device_args(CUdevice dev, int *phys, bool bad_args)
{
    CUresult rc = sim_device(dev, phys);
    return rc ? rc : bad_args ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUdevice sim_ordinal(int phys)
{
    for (int i = 0; i < sim_drv.visible_count; i++) {
        if (sim_drv.visible[i] == phys)
            return i;
    }
    return -1;
}

/* Device `i` as it is now: a GPU, or a MIG device (a GPU instance with
 * its compute instance; NVML may change the MIG layout at any time, so it
 * is read as a whole copy, simmig.h). False for anything else. */
static bool device_now(unsigned i, struct sim_gpu_config *out)
{
    const struct sim_config *cfg = sim_cfg();
    if (i < cfg->gpu_count) {
        *out = cfg->gpu[i];
        out->mig_mode = sim_mig_load(&cfg->gpu[i].mig_mode);
        return true;
    }
    return sim_mig_entry(cfg, i, out) && sim_mig_is_device(out);
}

/* The GPU or MIG device a UUID (or a unique prefix of one) names. */
static int device_by_uuid(const char *entry)
{
    int found = -1;
    for (unsigned i = 0; i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config d;
        if (!device_now(i, &d))
            continue;
        d.uuid[sizeof(d.uuid) - 1] = '\0';
        if (strncasecmp(d.uuid, entry, strlen(entry)) == 0) {
            if (found >= 0)
                return -1; /* ambiguous prefix */
            found = (int)i;
        }
    }
    return found;
}

/* "MIG-GPU-<uuid>/<gi>/<ci>", the form drivers before R470 named MIG
 * devices by, still accepted in CUDA_VISIBLE_DEVICES. */
static int mig_by_parent(const char *entry)
{
    const struct sim_config *cfg = sim_cfg();
    char uuid[SIM_UUID_LEN];
    unsigned gi, ci;
    const char *slash = strchr(entry, '/');
    if (!slash || (size_t)(slash - entry) >= sizeof(uuid) || sscanf(slash, "/%u/%u", &gi, &ci) != 2)
        return -1;
    memcpy(uuid, entry, (size_t)(slash - entry));
    uuid[slash - entry] = '\0';
    int parent = device_by_uuid(uuid);
    for (unsigned i = cfg->gpu_count; parent >= 0 && (unsigned)parent < cfg->gpu_count && i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config m;
        if (device_now(i, &m) && m.mig_parent == (unsigned)parent + 1 && m.gi_id == gi && m.ci_id == ci)
            return (int)i;
    }
    return -1;
}

/* The device a CUDA_VISIBLE_DEVICES entry names: an index or a UUID
 * prefix of a GPU outside MIG mode, or a MIG device by its UUID. A GPU in
 * MIG mode is no CUDA device itself: only its MIG devices are. */
static int visible_entry(const char *entry)
{
    const struct sim_config *cfg = sim_cfg();
    int dev = -1;
    if (strncmp(entry, "MIG-GPU-", 8) == 0)
        return mig_by_parent(entry + 4);
    if (strncmp(entry, "GPU-", 4) == 0 || strncmp(entry, "MIG-", 4) == 0) {
        dev = device_by_uuid(entry);
    } else {
        char *end;
        long idx = strtol(entry, &end, 10);
        if (end != entry && *end == '\0' && idx >= 0 && idx < (long)cfg->gpu_count)
            dev = (int)idx;
    }
    return dev >= 0 && (unsigned)dev < cfg->gpu_count && sim_mig_load(&cfg->gpu[dev].mig_mode) ? -1 : dev;
}

/* The first MIG device of a GPU in MIG mode, -1 if it has none. */
static int first_mig_device(unsigned gpu)
{
    const struct sim_config *cfg = sim_cfg();
    for (unsigned i = cfg->gpu_count; i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config m;
        if (device_now(i, &m) && m.mig_parent == gpu + 1)
            return (int)i;
    }
    return -1;
}

/* CUDA_VISIBLE_DEVICES as the driver reads it: the listed devices become
 * ordinals 0, 1, ... in that order; the list ends at the first entry that
 * names no device (or one already listed). Unset: every GPU outside MIG
 * mode, and for the first GPU in MIG mode its first MIG device. A process
 * enumerates one MIG device at most (NVIDIA's MIG user guide): later MIG
 * entries are passed over. */
static void read_visible_devices(void)
{
    const struct sim_config *cfg = sim_cfg();
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    bool have_mig = false;
    sim_drv.visible_count = 0;
    if (!env) {
        for (unsigned i = 0; i < cfg->gpu_count; i++) {
            bool mig = sim_mig_load(&cfg->gpu[i].mig_mode);
            int dev = mig ? (have_mig ? -1 : first_mig_device(i)) : (int)i;
            if (dev < 0)
                continue;
            have_mig = have_mig || mig;
            sim_drv.visible[sim_drv.visible_count++] = dev;
        }
        return;
    }
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", env);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        int g = visible_entry(tok);
        if (g < 0 || sim_ordinal(g) >= 0)
            break;
        bool mig = (unsigned)g >= cfg->gpu_count;
        if (mig && have_mig)
            continue;
        have_mig = have_mig || mig;
        sim_drv.visible[sim_drv.visible_count++] = g;
    }
}

SIM_EXPORT CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    /* Works before cuInit, as in the real driver; the config may not be
     * mapped yet, so fall back to what the default machine reports. */
    *driverVersion = sim_check_init() == CUDA_SUCCESS ? (int)sim_cfg()->driver_version : 13000;
    return CUDA_SUCCESS;
}

/* ---- errors ---------------------------------------------------------------- */

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} error_table[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_UNSUPPORTED_LIMIT, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported on this architecture"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "primary context active"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
    {CUDA_ERROR_MPS_CONNECTION_FAILED, "CUDA_ERROR_MPS_CONNECTION_FAILED", "MPS client failed to connect to the MPS control daemon or the MPS server"},
    {CUDA_ERROR_MPS_SERVER_NOT_READY, "CUDA_ERROR_MPS_SERVER_NOT_READY", "the MPS server is not ready to accept new MPS client requests"},
    {CUDA_ERROR_MPS_CLIENT_TERMINATED, "CUDA_ERROR_MPS_CLIENT_TERMINATED", "the MPS client has been terminated by the server"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

CUresult sim_error_lookup(CUresult error, const char **pStr, bool name)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(error_table) / sizeof(error_table[0]); i++) {
        if (error_table[i].code == error) {
            *pStr = name ? error_table[i].name : error_table[i].text;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ---- entry-point lookup ------------------------------------------------------ */

_Static_assert(CUDA_ERROR_NOT_SUPPORTED == 801, "driver_stubs.c returns CUDA_ERROR_NOT_SUPPORTED as 801");

static const struct sim_proc proc_table[] = {
#define CU_FN(symbol, base, since, kind, params) {#base, since, SIM_PROC_##kind, (void *)symbol},
#include "cgpu/cuda_functions.def"
#undef CU_FN
};

/* Of two answers for the name asked, the better one: the variant asked for
 * over the other, then the newer. */
static bool proc_better(const struct sim_proc *e, const struct sim_proc *best, enum sim_proc_kind want)
{
    return !best || (e->kind == want && best->kind != want) || (e->kind == best->kind && e->since > best->since);
}

/* Which exported function a CUDA runtime built for cudaVersion gets for a
 * base name: the newest variant it knows, the per-thread-stream one if asked.
 * Modelled functions and stubs answer alike, as every name a real driver
 * knows resolves on it. */
CUresult sim_lookup_proc(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    enum sim_proc_kind want = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) ? SIM_PROC_PTSZ
                                                                                        : SIM_PROC_DEFAULT;
    const struct sim_proc *tables[] = {proc_table, sim_stub_procs};
    const size_t sizes[] = {sizeof(proc_table) / sizeof(proc_table[0]), sim_stub_proc_count};
    const struct sim_proc *best = NULL;
    bool known = false;
    for (size_t t = 0; t < 2; t++) {
        for (size_t i = 0; i < sizes[t]; i++) {
            const struct sim_proc *e = &tables[t][i];
            if (strcmp(e->base, symbol) != 0)
                continue;
            known = true;
            if (e->since > cudaVersion || (e->kind == SIM_PROC_PTSZ && want != SIM_PROC_PTSZ))
                continue;
            if (proc_better(e, best, want))
                best = e;
        }
    }
    *pfn = best ? best->fn : NULL;
    if (status)
        *status = best    ? CU_GET_PROC_ADDRESS_SUCCESS
                  : known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                          : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return best ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* ---- devices ------------------------------------------------------------------- */

SIM_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult rc = sim_check_init_args(!device);
    if (rc)
        return rc;
    if (ordinal < 0 || ordinal >= sim_drv.visible_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetCount(int *count)
{
    CUresult rc = sim_check_init_args(!count);
    if (rc)
        return rc;
    *count = sim_drv.visible_count;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !name || len <= 0);
    if (rc)
        return rc;
    snprintf(name, (size_t)len, "%s", sim_cfg()->gpu[phys].name);
    return CUDA_SUCCESS;
}

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* The 16 bytes of a "GPU-..." or "MIG-..." UUID string. */
static void uuid_bytes(const char *s, CUuuid *uuid)
{
    s += strncmp(s, "GPU-", 4) == 0 || strncmp(s, "MIG-", 4) == 0 ? 4 : 0;
    memset(uuid->bytes, 0, sizeof(uuid->bytes));
    for (int n = 0; *s && n < 32; s++) {
        int v = hexval(*s);
        if (v < 0)
            continue;
        uuid->bytes[n / 2] = (char)(uuid->bytes[n / 2] | (n % 2 ? v : v << 4));
        n++;
    }
}

/* A MIG device's own UUID (its compute instance), as CUDA 11.4 added. */
SIM_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !uuid);
    if (rc)
        return rc;
    uuid_bytes(sim_cfg()->gpu[phys].uuid, uuid);
    return CUDA_SUCCESS;
}

/* The first version names the GPU: a MIG device's parent. */
SIM_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !uuid);
    if (rc)
        return rc;
    const struct sim_gpu_config *g = &sim_cfg()->gpu[phys];
    uint32_t parent = (unsigned)phys >= sim_cfg()->gpu_count ? sim_mig_load(&g->mig_parent) : 0;
    uuid_bytes(parent && parent <= sim_cfg()->gpu_count ? sim_cfg()->gpu[parent - 1].uuid : g->uuid, uuid);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !bytes);
    if (rc)
        return rc;
    *bytes = (size_t)sim_cfg()->gpu[phys].total_mem;
    return CUDA_SUCCESS;
}

static int attribute_value(const struct sim_gpu_config *g, CUdevice_attribute a, bool *ok)
{
    *ok = true;
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return 49152;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: return 65536;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return 65536;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: return 1980000;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return (int)g->sm_count;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: return 0;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: return 1;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: return 0;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: return 1;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: return (int)g->pci_bus;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: return (int)g->pci_device;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: return (int)g->pci_domain;
    case CU_DEVICE_ATTRIBUTE_TCC_DRIVER: return 0;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: return 2619000;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: return 5120;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: return 50331648;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: return 2048;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: return 3;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return (int)g->cc_major;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return (int)g->cc_minor;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 233472;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: return 1;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: return 1;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: return 1;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return 232448;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: return 32;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1;
    default:
        /* Attributes we do not model read as 0 ("not supported"), which is
         * what the driver reports for features a GPU lacks. */
        *ok = a > 0 && a < CU_DEVICE_ATTRIBUTE_MAX;
        return 0;
    }
}

SIM_EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !pi);
    if (rc)
        return rc;
    bool ok;
    int v = attribute_value(&sim_cfg()->gpu[phys], attrib, &ok);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    if (attrib == CU_DEVICE_ATTRIBUTE_COMPUTE_MODE) /* set through NVML, shared by every process */
        v = (int)atomic_load(&sim_drv.shared.st->gpu[phys].compute_mode);
    *pi = v;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !major || !minor);
    if (rc)
        return rc;
    *major = (int)sim_cfg()->gpu[phys].cc_major;
    *minor = (int)sim_cfg()->gpu[phys].cc_minor;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !pciBusId || len <= 0);
    if (rc)
        return rc;
    const struct sim_gpu_config *g = &sim_cfg()->gpu[phys];
    snprintf(pciBusId, (size_t)len, "%04x:%02x:%02x.0", g->pci_domain, g->pci_bus, g->pci_device);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    unsigned dom, bus, devno;
    if (!dev || !pciBusId)
        return CUDA_ERROR_INVALID_VALUE;
    if (sscanf(pciBusId, "%x:%x:%x", &dom, &bus, &devno) != 3) {
        dom = 0;
        if (sscanf(pciBusId, "%x:%x", &bus, &devno) != 2)
            return CUDA_ERROR_INVALID_VALUE;
    }
    for (int ordinal = 0; ordinal < sim_drv.visible_count; ordinal++) {
        const struct sim_gpu_config *g = &sim_cfg()->gpu[sim_drv.visible[ordinal]];
        if (g->pci_domain == dom && g->pci_bus == bus && g->pci_device == devno) {
            *dev = ordinal;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

/* sim_device for the two devices of a peer query. */
static CUresult device_pair(CUdevice a, CUdevice b, int *phys_a, int *phys_b)
{
    CUresult rc = sim_device(a, phys_a);
    return rc ? rc : sim_device(b, phys_b);
}

SIM_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    int phys, peer;
    CUresult rc = device_pair(dev, peerDev, &phys, &peer);
    if (rc)
        return rc;
    if (!canAccessPeer)
        return CUDA_ERROR_INVALID_VALUE;
    *canAccessPeer = phys != peer && (((sim_cfg()->gpu[phys].nvlink_peers >> peer) & 1u) ||
                                      (sim_cfg()->gpu[phys].nvswitch_links && sim_cfg()->gpu[peer].nvswitch_links));
    return CUDA_SUCCESS;
}

/* Peers are GPUs joined by NVLink: they reach each other's memory and
 * atomics; without a link, nothing (the simulation has no PCIe P2P). */
SIM_EXPORT CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice srcDevice,
                                            CUdevice dstDevice)
{
    int src, dst;
    CUresult rc = device_pair(srcDevice, dstDevice, &src, &dst);
    if (rc)
        return rc;
    if (src == dst)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    int peer = ((sim_cfg()->gpu[src].nvlink_peers >> dst) & 1u) ||
               (src != dst && sim_cfg()->gpu[src].nvswitch_links && sim_cfg()->gpu[dst].nvswitch_links);
    switch (attrib) {
    case CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK: *value = 0; break;
    case CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED:
    case CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED:
    case CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED: *value = peer; break;
    case CU_DEVICE_P2P_ATTRIBUTE_ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED: *value = 0; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* ---- contexts ------------------------------------------------------------------- */

#define CTX_STACK_MAX 16
static _Thread_local struct sim_ctx *ctx_stack[CTX_STACK_MAX];
static _Thread_local int ctx_depth;

struct sim_ctx *sim_current_ctx(void)
{
    return ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL;
}

bool sim_ctx_valid(const struct sim_ctx *ctx)
{
    return ctx && ctx->magic == MAGIC_CTX;
}

/* A GPU that fell off the bus fails every call that needs it with
 * CUDA_ERROR_UNKNOWN (what applications report after an XID 79), and a
 * context from before the loss stays broken after the GPU is back. */
static CUresult gpu_usable(int phys, const struct sim_ctx *ctx)
{
    const struct sim_state *st = sim_drv.shared.st;
    if (sim_gpu_lost(st, phys) || (ctx && ctx->lost_count != sim_gpu_lost_count(st, phys)))
        return CUDA_ERROR_UNKNOWN;
    return CUDA_SUCCESS;
}

CUresult sim_require_ctx(struct sim_ctx **out)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_ctx *ctx = sim_current_ctx();
    if (!sim_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    rc = sim_mps_check();
    if (rc)
        return rc;
    rc = gpu_usable(ctx->dev, ctx);
    if (rc)
        return rc;
    *out = ctx;
    return CUDA_SUCCESS;
}

CUresult sim_require_ctx_args(struct sim_ctx **out, bool bad_args)
{
    CUresult rc = sim_require_ctx(out);
    return rc ? rc : bad_args ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

void sim_ctx_note_end(struct sim_ctx *ctx, uint64_t end)
{
    uint64_t cur = atomic_load(&ctx->last_end);
    while (cur < end && !atomic_compare_exchange_weak(&ctx->last_end, &cur, end)) {
    }
}

/* The process's first context on a GPU puts it on the GPU and costs the
 * driver's context memory (context_mib), held until the process exits: what
 * a real driver charges and libcgpu never sees. OUT_OF_MEMORY when it does
 * not fit, as a real context creation fails on a full GPU. */
static CUresult use_gpu(int dev)
{
    pthread_mutex_lock(&sim_drv.lock);
    int rc = sim_use_gpu(&sim_drv.shared, dev, sim_cfg()->context_bytes);
    pthread_mutex_unlock(&sim_drv.lock);
    /* Another process holds an EXCLUSIVE_PROCESS GPU (or it is PROHIBITED):
     * what a real driver answers ("busy or unavailable"). */
    return rc == 0 ? CUDA_SUCCESS : rc == -1 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_DEVICE_UNAVAILABLE;
}

/* The checks that open a context on device `dev`: sim_device_args, the GPU
 * still on the bus, then use_gpu. */
static CUresult context_device(CUdevice dev, int *phys, bool bad_args)
{
    CUresult rc = sim_device_args(dev, phys, bad_args);
    if (!rc)
        rc = gpu_usable(*phys, NULL);
    return rc ? rc : use_gpu(*phys);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    int phys;
    CUresult rc = context_device(dev, &phys, !pctx);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    if (sim_drv.primary_refs[phys]++ == 0)
        sim_drv.primary[phys].lost_count = sim_gpu_lost_count(sim_drv.shared.st, phys);
    pthread_mutex_unlock(&sim_drv.lock);
    *pctx = (CUcontext)&sim_drv.primary[phys];
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    int phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    if (sim_drv.primary_refs[phys] > 0) {
        if (--sim_drv.primary_refs[phys] == 0)
            sim_ctx_drop_limits(&sim_drv.primary[phys]); /* the primary context goes */
    } else {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    int phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    sim_drv.primary_refs[phys] = 0;
    sim_ctx_drop_limits(&sim_drv.primary[phys]);
    pthread_mutex_unlock(&sim_drv.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, !flags || !active);
    if (rc)
        return rc;
    pthread_mutex_lock(&sim_drv.lock);
    *flags = sim_drv.primary[phys].flags;
    *active = sim_drv.primary_refs[phys] > 0;
    pthread_mutex_unlock(&sim_drv.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    int phys;
    CUresult rc = sim_device_args(dev, &phys, flags & ~0xffu);
    if (rc)
        return rc;
    sim_drv.primary[phys].flags = flags;
    return CUDA_SUCCESS;
}

static CUresult push_ctx(struct sim_ctx *ctx)
{
    if (ctx_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    ctx_stack[ctx_depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult sim_ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    int phys;
    CUresult rc = context_device(dev, &phys, !pctx || (flags & ~0xffu));
    if (rc)
        return rc;
    struct sim_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *ctx = (struct sim_ctx){.magic = MAGIC_CTX, .dev = phys, .flags = flags,
                            .lost_count = sim_gpu_lost_count(sim_drv.shared.st, phys)};
    ctx->legacy = (struct sim_stream){.magic = MAGIC_STREAM, .ctx = ctx};
    rc = push_ctx(ctx);
    if (rc) {
        free(ctx);
        return rc;
    }
    *pctx = (CUcontext)ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                   unsigned int flags, CUdevice dev)
{
    if (numParams < 0 || (numParams > 0 && !paramsArray))
        return CUDA_ERROR_INVALID_VALUE;
    return sim_ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                   CUdevice dev)
{
    if (ctxCreateParams && ctxCreateParams->numExecAffinityParams < 0)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext hctx)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_ctx *ctx = (struct sim_ctx *)hctx;
    if (!sim_ctx_valid(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < ctx_depth; i++) {
        if (ctx_stack[i] == ctx) {
            memmove(&ctx_stack[i], &ctx_stack[i + 1], (size_t)(ctx_depth - i - 1) * sizeof(ctx_stack[0]));
            ctx_depth--;
            i--;
        }
    }
    pthread_mutex_lock(&sim_drv.lock);
    sim_ctx_drop_limits(ctx);
    pthread_mutex_unlock(&sim_drv.lock);
    ctx->magic = MAGIC_DEAD;
    free(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext hctx)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_ctx_valid((struct sim_ctx *)hctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return push_ctx((struct sim_ctx *)hctx);
}

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (ctx_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_ctx *ctx = ctx_stack[--ctx_depth];
    if (pctx)
        *pctx = (CUcontext)ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext hctx)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_ctx *ctx = (struct sim_ctx *)hctx;
    if (!ctx) {
        if (ctx_depth > 0)
            ctx_depth--;
        return CUDA_SUCCESS;
    }
    if (!sim_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_depth == 0)
        return push_ctx(ctx);
    ctx_stack[ctx_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult rc = sim_check_init_args(!pctx);
    if (rc)
        return rc;
    *pctx = (CUcontext)sim_current_ctx();
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !device);
    if (rc)
        return rc;
    *device = sim_ordinal(ctx->dev);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSynchronize(void)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    sim_sleep_until(atomic_load(&ctx->last_end));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetApiVersion(CUcontext hctx, unsigned int *version)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_ctx *ctx = hctx ? (struct sim_ctx *)hctx : sim_current_ctx();
    if (!sim_ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = 12050;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetFlags(unsigned int *flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !flags);
    if (rc)
        return rc;
    *flags = ctx->flags;
    return CUDA_SUCCESS;
}

/* A preference only: the simulation keeps it for the query and times
 * kernels the same whatever it says. */
SIM_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache config)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, (unsigned)config > CU_FUNC_CACHE_PREFER_EQUAL);
    if (rc)
        return rc;
    ctx->cache_config = config;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache *pconfig)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !pconfig);
    if (rc)
        return rc;
    *pconfig = ctx->cache_config;
    return CUDA_SUCCESS;
}

/* Either pointer may be NULL, as in the driver. */
SIM_EXPORT CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (leastPriority)
        *leastPriority = SIM_STREAM_PRIORITY_LEAST;
    if (greatestPriority)
        *greatestPriority = SIM_STREAM_PRIORITY_GREATEST;
    return CUDA_SUCCESS;
}

/* ---- occupancy ------------------------------------------------------------------ */

/* A compute capability 9.0 SM: what bounds how many blocks it holds. */
#define SM_THREADS 2048
#define SM_BLOCKS 32
#define SM_REGS 65536
#define SM_REG_UNIT 256           /* registers are given to warps in units of 256 */
#define SM_SHARED 233472
#define BLOCK_SHARED_RESERVED 1024 /* the driver's per-block share of shared memory */

/* Blocks of `block` threads using `smem` dynamic shared memory one SM holds
 * at once; 0 when one does not fit. */
static int blocks_per_sm(CUfunction f, int block, size_t smem, CUresult *rc)
{
    int regs, static_smem, max_dyn, max_threads;
    if ((*rc = cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f)) ||
        (*rc = cuFuncGetAttribute(&static_smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f)) ||
        (*rc = cuFuncGetAttribute(&max_dyn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, f)) ||
        (*rc = cuFuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f)))
        return 0;
    if (block > max_threads || smem > (size_t)max_dyn)
        return 0;
    int warps = (block + 31) / 32;
    int per_warp_regs = (regs * 32 + SM_REG_UNIT - 1) / SM_REG_UNIT * SM_REG_UNIT;
    int by_threads = SM_THREADS / (warps * 32);
    int by_regs = per_warp_regs ? SM_REGS / per_warp_regs / warps : SM_BLOCKS;
    int by_smem = (int)(SM_SHARED / (smem + (size_t)static_smem + BLOCK_SHARED_RESERVED));
    int n = SM_BLOCKS;
    n = by_threads < n ? by_threads : n;
    n = by_regs < n ? by_regs : n;
    return by_smem < n ? by_smem : n;
}

SIM_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction func,
                                                                         int blockSize, size_t dynamicSMemSize,
                                                                         unsigned int flags)
{
    if (!numBlocks || blockSize <= 0 || (flags & ~(unsigned)CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc;
    int n = blocks_per_sm(func, blockSize, dynamicSMemSize, &rc);
    if (rc == CUDA_SUCCESS)
        *numBlocks = n;
    return rc;
}

/* The block size (a multiple of the warp) that keeps the most threads
 * resident, the larger on a tie; the grid that fills every SM with it. */
SIM_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize, CUfunction func,
                                                              CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                              size_t dynamicSMemSize, int blockSizeLimit,
                                                              unsigned int flags)
{
    int max_threads;
    CUresult rc = cuFuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, func);
    if (rc)
        return rc;
    if (!minGridSize || !blockSize || blockSizeLimit < 0 || (flags & ~(unsigned)CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE))
        return CUDA_ERROR_INVALID_VALUE;
    int limit = blockSizeLimit && blockSizeLimit < max_threads ? blockSizeLimit : max_threads;
    int best_block = 0, best_blocks = 0;
    for (int b = (limit + 31) / 32 * 32; b > 0; b -= 32) {
        int size = b > limit ? limit : b;
        size_t smem = blockSizeToDynamicSMemSize ? blockSizeToDynamicSMemSize(size) : dynamicSMemSize;
        int n = blocks_per_sm(func, size, smem, &rc);
        if (rc)
            return rc;
        if (n * size > best_blocks * best_block) {
            best_block = size;
            best_blocks = n;
        }
    }
    struct sim_ctx *ctx = sim_current_ctx();
    int sms = sim_ctx_valid(ctx) ? (int)sim_cfg()->gpu[ctx->dev].sm_count : 0;
    *blockSize = best_block;
    *minGridSize = best_blocks * sms;
    return CUDA_SUCCESS;
}

/* ---- ids -------------------------------------------------------------------------- */

/* Ids are unique in the process and never reused, given on first ask. */
static unsigned long long object_id(uint64_t *id)
{
    pthread_mutex_lock(&sim_drv.lock);
    if (!*id)
        *id = ++sim_drv.next_object_id;
    unsigned long long v = *id;
    pthread_mutex_unlock(&sim_drv.lock);
    return v;
}

SIM_EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId)
{
    struct sim_ctx *c = (struct sim_ctx *)ctx;
    CUresult rc = c ? sim_check_init() : sim_require_ctx(&c);
    if (rc)
        return rc;
    if (!sim_ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!ctxId)
        return CUDA_ERROR_INVALID_VALUE;
    *ctxId = object_id(&c->id);
    return CUDA_SUCCESS;
}

CUresult sim_stream_id(CUstream h, bool per_thread, unsigned long long *id)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream_args(h, per_thread, &s, !id);
    if (rc)
        return rc;
    *id = object_id(&s->id);
    return CUDA_SUCCESS;
}
