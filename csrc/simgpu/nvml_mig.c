/* NVML's Multi-Instance GPU calls over the simulated GPUs: MIG mode, GPU
 * and compute instances (queried, created, destroyed), MIG device handles
 * (simmig.h has the profiles and the shared layout).
 *
 * The configuration boots a layout; these calls change it for every
 * process (the shared state). A GPU instance has at most one compute
 * instance, over all its slices (`nvidia-smi mig -cci` of the full
 * profile); smaller compute instances are not modelled (NOT_SUPPORTED).
 *
 * Handles: a GPU instance and its compute instance are named by their
 * entry's index, as are MIG device handles (g_dev); a handle of an entry
 * freed since is INVALID_ARGUMENT. Thread-safety: every read of the layout
 * is a whole copy (sim_mig_entry); changes take the state's MIG lock. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "nvml_internal.h"
#include "simmig.h"

_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_t) == 48, "nvmlGpuInstanceProfileInfo_t layout");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v2_t) == 152, "nvmlGpuInstanceProfileInfo_v2_t layout");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v3_t) == 152, "nvmlGpuInstanceProfileInfo_v3_t layout");
_Static_assert(sizeof(nvmlGpuInstanceInfo_t) == 24, "nvmlGpuInstanceInfo_t layout");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_v2_t) == 136, "nvmlComputeInstanceProfileInfo_v2_t layout");
_Static_assert(sizeof(nvmlComputeInstanceInfo_t) == 32, "nvmlComputeInstanceInfo_t layout");

struct nvmlGpuInstance_st {
    unsigned int dev;
};

struct nvmlComputeInstance_st {
    unsigned int dev;
};

static struct nvmlGpuInstance_st g_gi[SIM_MAX_GPUS] = {
#define GI(i) [i] = {i}
    GI(0), GI(1), GI(2), GI(3), GI(4), GI(5), GI(6), GI(7),
    GI(8), GI(9), GI(10), GI(11), GI(12), GI(13), GI(14), GI(15),
#undef GI
};
static struct nvmlComputeInstance_st g_ci[SIM_MAX_GPUS] = {
#define CI(i) [i] = {i}
    CI(0), CI(1), CI(2), CI(3), CI(4), CI(5), CI(6), CI(7),
    CI(8), CI(9), CI(10), CI(11), CI(12), CI(13), CI(14), CI(15),
#undef CI
};
_Static_assert(SIM_MAX_GPUS == 16, "one GI and CI handle per device");

static const struct sim_config *live(void)
{
    return &g_sim.st->config;
}

bool dev_view(unsigned int dev, struct sim_gpu_config *out)
{
    if (dev < g_cfg.gpu_count) {
        *out = g_cfg.gpu[dev];
        out->mig_mode = sim_mig_load(&live()->gpu[dev].mig_mode);
        return true;
    }
    if (!sim_mig_entry(live(), dev, out))
        return false;
    out->name[sizeof(out->name) - 1] = '\0';
    out->uuid[sizeof(out->uuid) - 1] = '\0';
    out->pci_bus_id[sizeof(out->pci_bus_id) - 1] = '\0';
    return out->mig_parent <= g_cfg.gpu_count;
}

static unsigned int parent_of(const struct sim_gpu_config *v, unsigned int dev)
{
    return v->mig_parent ? v->mig_parent - 1 : dev;
}

nvmlReturn_t lookup_any(nvmlDevice_t device, unsigned int *dev, struct sim_gpu_config *view)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    struct sim_gpu_config v;
    for (unsigned int i = 0; i < SIM_MAX_GPUS; i++) {
        if (device != &g_dev[i])
            continue;
        if (!dev_view(i, &v) || (i >= g_cfg.gpu_count && !sim_mig_is_device(&v)))
            return NVML_ERROR_INVALID_ARGUMENT;
        *dev = i;
        if (view)
            *view = v;
        return sim_gpu_lost(g_sim.st, (int)parent_of(&v, i)) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

unsigned long long mig_used_bytes(unsigned int dev)
{
    unsigned long long used = atomic_load(&g_sim.st->gpu[dev].used);
    for (unsigned int i = g_cfg.gpu_count; dev < g_cfg.gpu_count && i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config m;
        if (dev_view(i, &m) && m.mig_parent == dev + 1)
            used += atomic_load(&g_sim.st->gpu[i].used);
    }
    return used;
}

/* A GPU in MIG mode: SUCCESS; NOT_SUPPORTED for a GPU that cannot or is not
 * in MIG mode; the lookup's error for a bad or MIG device handle. */
static nvmlReturn_t lookup_mig_gpu(nvmlDevice_t device, unsigned int *gpu)
{
    nvmlReturn_t rc = lookup(device, gpu);
    return rc == NVML_SUCCESS && !sim_mig_load(&live()->gpu[*gpu].mig_mode) ? NVML_ERROR_NOT_SUPPORTED : rc;
}

static nvmlReturn_t lookup_mig_device(nvmlDevice_t device, unsigned int *dev, struct sim_gpu_config *view)
{
    nvmlReturn_t rc = lookup_any(device, dev, view);
    return rc == NVML_SUCCESS && *dev < g_cfg.gpu_count ? NVML_ERROR_NOT_SUPPORTED : rc;
}

/* What a layout change answers. */
static nvmlReturn_t mig_rc(enum sim_mig_rc rc)
{
    switch (rc) {
    case SIM_MIG_OK: return NVML_SUCCESS;
    case SIM_MIG_NOT_SUPPORTED: return NVML_ERROR_NOT_SUPPORTED;
    case SIM_MIG_IN_USE: return NVML_ERROR_IN_USE;
    case SIM_MIG_NO_ROOM: return NVML_ERROR_INSUFFICIENT_RESOURCES;
    case SIM_MIG_BUSY: return NVML_ERROR_TIMEOUT;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    unsigned int g;
    nvmlReturn_t rc = lookup(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (currentMode == NULL || pendingMode == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* Every simulated GPU is an H100 by name and compute capability, which
     * answers; only the 80 GiB shape can be in MIG mode (simmig.h). */
    *currentMode = *pendingMode =
        sim_mig_load(&live()->gpu[g].mig_mode) ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

/* Takes effect at once (the simulation needs no GPU reset): current and
 * pending mode are the same again, and activationStatus is SUCCESS. Root
 * only; IN_USE while a process uses the GPU (enabling) or while it has GPU
 * instances (disabling). */
NVML_EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus)
{
    unsigned int g;
    nvmlReturn_t rc = lookup(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (activationStatus == NULL || (mode != NVML_DEVICE_MIG_ENABLE && mode != NVML_DEVICE_MIG_DISABLE))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (geteuid() != 0)
        return NVML_ERROR_NO_PERMISSION;
    rc = mig_rc(sim_mig_set_mode(&g_sim, g, mode == NVML_DEVICE_MIG_ENABLE));
    *activationStatus = rc;
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_any(device, &d, NULL);
    if (rc == NVML_SUCCESS && isMigDevice == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *isMigDevice = d >= g_cfg.gpu_count;
    return rc;
}

/* "Zero if MIG is not supported or enabled" (NVML's reference). */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    unsigned int g;
    nvmlReturn_t rc = lookup(device, &g);
    if (rc == NVML_SUCCESS && count == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *count = sim_mig_load(&live()->gpu[g].mig_mode) ? SIM_MIG_COMPUTE_SLICES : 0;
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                             nvmlDevice_t *migDevice)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_mig_gpu(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (migDevice == NULL || index >= SIM_MIG_COMPUTE_SLICES)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (unsigned int i = g_cfg.gpu_count; i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config m;
        if (!dev_view(i, &m) || !sim_mig_is_device(&m) || m.mig_parent != g + 1)
            continue;
        if (n++ == index) {
            *migDevice = &g_dev[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    unsigned int d;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_any(migDevice, &d, &v);
    if (rc != NVML_SUCCESS)
        return rc;
    if (device == NULL || d < g_cfg.gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_dev[parent_of(&v, d)];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    unsigned int d;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_mig_device(device, &d, &v);
    if (rc == NVML_SUCCESS && id == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *id = v.gi_id;
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    unsigned int d;
    struct sim_gpu_config v;
    nvmlReturn_t rc = lookup_mig_device(device, &d, &v);
    if (rc == NVML_SUCCESS && id == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *id = v.ci_id;
    return rc;
}

/* A GPU reports itself as one whole instance; a MIG device its profile. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    unsigned int d;
    struct sim_gpu_config g;
    nvmlReturn_t rc = lookup_any(device, &d, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (attributes == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *p = d >= g_cfg.gpu_count ? sim_mig_by_index(g.mig_profile) : NULL;
    *attributes = (nvmlDeviceAttributes_t){
        .multiprocessorCount = g.sm_count,
        .sharedCopyEngineCount = p ? p->copy_engines : 3,
        .sharedDecoderCount = p ? p->decoders : 0,
        .sharedEncoderCount = p ? p->encoders : 0,
        .sharedJpegCount = p ? p->jpegs : 0,
        .sharedOfaCount = p ? p->ofas : 0,
        .gpuInstanceSliceCount = p ? p->slices : 7,
        .computeInstanceSliceCount = p ? p->slices : 7,
        .memorySizeMB = g.total_mem >> 20,
    };
    return NVML_SUCCESS;
}

/* The pre-MIG name binds the same struct. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
    __attribute__((alias("nvmlDeviceGetAttributes_v2")));

/* ---- GPU instances ---------------------------------------------------------- */

static void fill_gi_profile(const struct sim_mig_profile *p, nvmlGpuInstanceProfileInfo_t *info)
{
    *info = (nvmlGpuInstanceProfileInfo_t){
        .id = p->id,
        .isP2pSupported = 0,
        .sliceCount = p->slices,
        .instanceCount = p->instance_count,
        .multiprocessorCount = p->sms,
        .copyEngineCount = p->copy_engines,
        .decoderCount = p->decoders,
        .encoderCount = p->encoders,
        .jpegCount = p->jpegs,
        .ofaCount = p->ofas,
        .memorySizeMB = p->memory_mib,
    };
}

static nvmlReturn_t gi_profile(nvmlDevice_t device, unsigned int profile, const void *info,
                               const struct sim_mig_profile **out)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_mig_gpu(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (info == NULL || profile >= NVML_GPU_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = sim_mig_by_index(profile);
    return *out ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED; /* a profile this GPU does not have */
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_t *info)
{
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile(device, profile, info, &p);
    if (rc == NVML_SUCCESS)
        fill_gi_profile(p, info);
    return rc;
}

/* Takes the v2 and v3 structs, told apart by their version. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                              nvmlGpuInstanceProfileInfo_v2_t *info)
{
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile(device, profile, info, &p);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int version = info->version;
    nvmlGpuInstanceProfileInfo_t base;
    fill_gi_profile(p, &base);
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    snprintf(name, sizeof(name), "MIG %s", p->name);
    if (version == nvmlGpuInstanceProfileInfo_v2) {
        *info = (nvmlGpuInstanceProfileInfo_v2_t){version, base.id, base.isP2pSupported, base.sliceCount,
                                                  base.instanceCount, base.multiprocessorCount,
                                                  base.copyEngineCount, base.decoderCount, base.encoderCount,
                                                  base.jpegCount, base.ofaCount, base.memorySizeMB, {0}};
        memcpy(info->name, name, sizeof(name));
        return NVML_SUCCESS;
    }
    if (version == nvmlGpuInstanceProfileInfo_v3) {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)(void *)info;
        *v3 = (nvmlGpuInstanceProfileInfo_v3_t){version, base.id, base.sliceCount, base.instanceCount,
                                                base.multiprocessorCount, base.copyEngineCount, base.decoderCount,
                                                base.encoderCount, base.jpegCount, base.ofaCount,
                                                base.memorySizeMB, {0}, 0};
        memcpy(v3->name, name, sizeof(name));
        return NVML_SUCCESS;
    }
    return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
}

/* A profile by its ID on a GPU in MIG mode. */
static nvmlReturn_t gi_profile_by_id(nvmlDevice_t device, unsigned int id, unsigned int *gpu,
                                     const struct sim_mig_profile **out)
{
    nvmlReturn_t rc = lookup_mig_gpu(device, gpu);
    if (rc != NVML_SUCCESS)
        return rc;
    *out = sim_mig_by_id(id);
    return *out ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* Every placement the profile allows, taken or not. With `placements`
 * NULL, only the count. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                       nvmlGpuInstancePlacement_t *placements,
                                                                       unsigned int *count)
{
    unsigned int g;
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile_by_id(device, profileId, &g, &p);
    if (rc != NVML_SUCCESS)
        return rc;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (placements == NULL) {
        *count = p->placements;
        return NVML_SUCCESS;
    }
    if (*count < p->placements) {
        *count = p->placements;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < p->placements; i++)
        placements[i] = (nvmlGpuInstancePlacement_t){p->starts[i], p->memory_slices};
    *count = p->placements;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                                   unsigned int *count)
{
    unsigned int g;
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile_by_id(device, profileId, &g, &p);
    if (rc == NVML_SUCCESS && count == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *count = sim_mig_remaining(live(), g, p);
    return rc;
}

/* Root only, as on a real driver; the instance has no compute instance yet. */
static nvmlReturn_t create_gi(nvmlDevice_t device, unsigned int profileId, int start, nvmlGpuInstance_t *gpuInstance)
{
    unsigned int g, dev;
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile_by_id(device, profileId, &g, &p);
    if (rc != NVML_SUCCESS)
        return rc;
    if (gpuInstance == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (geteuid() != 0)
        return NVML_ERROR_NO_PERMISSION;
    rc = mig_rc(sim_mig_create_gi(&g_sim, g, p, start, &dev));
    if (rc == NVML_SUCCESS)
        *gpuInstance = &g_gi[dev];
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                     nvmlGpuInstance_t *gpuInstance)
{
    return create_gi(device, profileId, -1, gpuInstance);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                                  const nvmlGpuInstancePlacement_t *placement,
                                                                  nvmlGpuInstance_t *gpuInstance)
{
    const struct sim_mig_profile *p = sim_mig_by_id(profileId);
    if (placement == NULL || (p && placement->size != p->memory_slices) || placement->start >= SIM_MIG_MEMORY_SLICES)
        return ready() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    return create_gi(device, profileId, (int)placement->start, gpuInstance);
}

/* The GPU instances of one profile; `gpuInstances` has room for the
 * profile's instanceCount, as NVML's reference asks. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                                   nvmlGpuInstance_t *gpuInstances, unsigned int *count)
{
    unsigned int g;
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile_by_id(device, profileId, &g, &p);
    if (rc != NVML_SUCCESS)
        return rc;
    if (gpuInstances == NULL || count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (unsigned int i = g_cfg.gpu_count; i < SIM_MAX_GPUS && n < p->instance_count; i++) {
        struct sim_gpu_config m;
        if (dev_view(i, &m) && m.mig_parent == g + 1 && m.mig_profile == p->index)
            gpuInstances[n++] = &g_gi[i];
    }
    *count = n;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                      nvmlGpuInstance_t *gpuInstance)
{
    unsigned int g;
    nvmlReturn_t rc = lookup_mig_gpu(device, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (gpuInstance == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = g_cfg.gpu_count; i < SIM_MAX_GPUS; i++) {
        struct sim_gpu_config m;
        if (dev_view(i, &m) && m.mig_parent == g + 1 && m.gi_id == id) {
            *gpuInstance = &g_gi[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* The entry behind a GPU instance handle, as it is now; INVALID_ARGUMENT
 * for anything else (a handle of an instance destroyed since included). */
static nvmlReturn_t lookup_gi(nvmlGpuInstance_t gi, const void *out, unsigned int *dev, struct sim_gpu_config *view)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned int i = g_cfg.gpu_count; i < SIM_MAX_GPUS; i++) {
        if (gi == &g_gi[i]) {
            if (!dev_view(i, view))
                return NVML_ERROR_INVALID_ARGUMENT;
            *dev = i;
            return out == NULL ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    unsigned int d;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_gi(gpuInstance, info, &d, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_mig_profile *p = sim_mig_by_index(m.mig_profile);
    *info = (nvmlGpuInstanceInfo_t){
        .device = &g_dev[parent_of(&m, d)],
        .id = m.gi_id,
        .profileId = p ? p->id : 0,
        .placement = {m.gi_start, p ? p->memory_slices : 0},
    };
    return NVML_SUCCESS;
}

/* Root only; IN_USE while it has its compute instance. */
NVML_EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
    unsigned int d;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_gi(gpuInstance, gpuInstance, &d, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (geteuid() != 0)
        return NVML_ERROR_NO_PERMISSION;
    return mig_rc(sim_mig_destroy_gi(&g_sim, d));
}

/* ---- compute instances -------------------------------------------------------- */

/* Compute slices of NVML_COMPUTE_INSTANCE_PROFILE_* `profile`, 0 if none
 * the simulation has. */
static unsigned int ci_slices(unsigned int profile)
{
    static const unsigned int slices[] = {1, 2, 3, 4, 7};
    return profile < sizeof(slices) / sizeof(slices[0]) ? slices[profile] : 0;
}

static nvmlReturn_t ci_profile(nvmlGpuInstance_t gi, unsigned int profile, unsigned int engProfile, const void *info,
                               nvmlComputeInstanceProfileInfo_t *out, const struct sim_mig_profile **gi_p)
{
    unsigned int d;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_gi(gi, info, &d, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *p = sim_mig_by_index(m.mig_profile);
    *gi_p = p;
    unsigned int slices = ci_slices(profile);
    if (p == NULL || slices == 0 || slices > p->slices)
        return NVML_ERROR_NOT_SUPPORTED;
    *out = (nvmlComputeInstanceProfileInfo_t){
        .id = profile,
        .sliceCount = slices,
        .instanceCount = p->slices / slices,
        .multiprocessorCount = p->sms * slices / p->slices,
        .sharedCopyEngineCount = p->copy_engines,
        .sharedDecoderCount = p->decoders,
        .sharedEncoderCount = p->encoders,
        .sharedJpegCount = p->jpegs,
        .sharedOfaCount = p->ofas,
    };
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance,
                                                                      unsigned int profile, unsigned int engProfile,
                                                                      nvmlComputeInstanceProfileInfo_t *info)
{
    nvmlComputeInstanceProfileInfo_t base;
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = ci_profile(gpuInstance, profile, engProfile, info, &base, &p);
    if (rc == NVML_SUCCESS)
        *info = base;
    return rc;
}

/* Takes the v2 and v3 structs, told apart by their version. */
NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance,
                                                                       unsigned int profile, unsigned int engProfile,
                                                                       nvmlComputeInstanceProfileInfo_v2_t *info)
{
    nvmlComputeInstanceProfileInfo_t b;
    const struct sim_mig_profile *p;
    nvmlReturn_t rc = ci_profile(gpuInstance, profile, engProfile, info, &b, &p);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int version = info->version;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    if (b.sliceCount == p->slices)
        snprintf(name, sizeof(name), "MIG %s", p->name);
    else
        snprintf(name, sizeof(name), "MIG %uc.%s", b.sliceCount, p->name);
    if (version == nvmlComputeInstanceProfileInfo_v2) {
        *info = (nvmlComputeInstanceProfileInfo_v2_t){version, b.id, b.sliceCount, b.instanceCount,
                                                      b.multiprocessorCount, b.sharedCopyEngineCount,
                                                      b.sharedDecoderCount, b.sharedEncoderCount, b.sharedJpegCount,
                                                      b.sharedOfaCount, {0}};
        memcpy(info->name, name, sizeof(name));
        return NVML_SUCCESS;
    }
    if (version == nvmlComputeInstanceProfileInfo_v3) {
        nvmlComputeInstanceProfileInfo_v3_t *v3 = (nvmlComputeInstanceProfileInfo_v3_t *)(void *)info;
        *v3 = (nvmlComputeInstanceProfileInfo_v3_t){version, b.id, b.sliceCount, b.instanceCount,
                                                    b.multiprocessorCount, b.sharedCopyEngineCount,
                                                    b.sharedDecoderCount, b.sharedEncoderCount, b.sharedJpegCount,
                                                    b.sharedOfaCount, {0}, 0};
        memcpy(v3->name, name, sizeof(name));
        return NVML_SUCCESS;
    }
    return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                            nvmlComputeInstance_t *computeInstances,
                                                            unsigned int *count)
{
    unsigned int d;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_gi(gpuInstance, computeInstances, &d, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (count == NULL || profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *p = sim_mig_by_index(m.mig_profile);
    *count = 0;
    if (p && p->ci_index == profileId && sim_mig_is_device(&m))
        computeInstances[(*count)++] = &g_ci[d];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                               nvmlComputeInstance_t *computeInstance)
{
    unsigned int d;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_gi(gpuInstance, computeInstance, &d, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!sim_mig_is_device(&m) || m.ci_id != id)
        return NVML_ERROR_NOT_FOUND;
    *computeInstance = &g_ci[d];
    return NVML_SUCCESS;
}

/* The entry behind a compute instance handle while it has its compute
 * instance; INVALID_ARGUMENT for anything else. */
static nvmlReturn_t lookup_ci(nvmlComputeInstance_t ci, const void *out, unsigned int *dev, struct sim_gpu_config *view)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned int i = g_cfg.gpu_count; i < SIM_MAX_GPUS; i++) {
        if (ci == &g_ci[i]) {
            if (!dev_view(i, view) || !sim_mig_is_device(view) || out == NULL)
                return NVML_ERROR_INVALID_ARGUMENT;
            *dev = i;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

NVML_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                       nvmlComputeInstanceInfo_t *info)
{
    unsigned int i;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_ci(computeInstance, info, &i, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_mig_profile *p = sim_mig_by_index(m.mig_profile);
    *info = (nvmlComputeInstanceInfo_t){
        .device = &g_dev[parent_of(&m, i)],
        .gpuInstance = &g_gi[i],
        .id = m.ci_id,
        .profileId = p ? p->ci_index : 0,
        .placement = {0, p ? p->slices : 0},
    };
    return NVML_SUCCESS;
}

/* The compute instance over the whole GPU instance, which makes it a MIG
 * device; smaller ones are not modelled (NOT_SUPPORTED). Root only. */
static nvmlReturn_t create_ci(nvmlGpuInstance_t gpuInstance, unsigned int profileId, unsigned int start,
                              nvmlComputeInstance_t *computeInstance)
{
    unsigned int d;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_gi(gpuInstance, computeInstance, &d, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_mig_profile *p = sim_mig_by_index(m.mig_profile);
    if (profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || p == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (profileId != p->ci_index || start != 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (geteuid() != 0)
        return NVML_ERROR_NO_PERMISSION;
    rc = mig_rc(sim_mig_create_ci(&g_sim, d));
    if (rc == NVML_SUCCESS)
        *computeInstance = &g_ci[d];
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                              nvmlComputeInstance_t *computeInstance)
{
    return create_ci(gpuInstance, profileId, 0, computeInstance);
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    nvmlGpuInstance_t gpuInstance, unsigned int profileId, const nvmlComputeInstancePlacement_t *placement,
    nvmlComputeInstance_t *computeInstance)
{
    if (placement == NULL)
        return ready() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    return create_ci(gpuInstance, profileId, placement->start, computeInstance);
}

/* Root only; IN_USE while a process has a context or memory on it. */
NVML_EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
    unsigned int d;
    struct sim_gpu_config m;
    nvmlReturn_t rc = lookup_ci(computeInstance, computeInstance, &d, &m);
    if (rc != NVML_SUCCESS)
        return rc;
    if (geteuid() != 0)
        return NVML_ERROR_NO_PERMISSION;
    return mig_rc(sim_mig_destroy_ci(&g_sim, d));
}

/* The first version took the same struct. */
NVML_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                                    nvmlComputeInstanceInfo_t *info)
    __attribute__((alias("nvmlComputeInstanceGetInfo_v2")));
