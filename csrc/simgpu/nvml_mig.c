/* NVML's Multi-Instance GPU queries over the simulated GPUs: MIG mode, GPU
 * and compute instances, MIG device handles (simmig.h has the profiles).
 *
 * The instances are those the configuration lays out; each GPU instance
 * holds one compute instance over all its slices (the default `nvidia-smi
 * mig -cgi ... -C`). Creating and destroying instances at run time is not
 * modelled: those entry points stay stubs (NOT_SUPPORTED).
 *
 * Handles: a GPU instance and its compute instance are named by the MIG
 * device's index, as are MIG device handles (g_dev). Thread-safety: the
 * handles are constant once NVML is initialised. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

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

static bool is_mig(unsigned int dev)
{
    return g_cfg.gpu[dev].mig_parent != 0;
}

static unsigned int parent_of(unsigned int dev)
{
    return is_mig(dev) ? g_cfg.gpu[dev].mig_parent - 1 : dev;
}

nvmlReturn_t lookup_any(nvmlDevice_t device, unsigned int *dev)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned int i = 0; i < g_cfg.gpu_count + g_cfg.mig_count; i++) {
        if (device == &g_dev[i]) {
            *dev = i;
            return sim_gpu_lost(g_sim.st, (int)parent_of(i)) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

unsigned long long mig_used_bytes(unsigned int dev)
{
    unsigned long long used = atomic_load(&g_sim.st->gpu[dev].used);
    for (unsigned int i = g_cfg.gpu_count; !is_mig(dev) && i < g_cfg.gpu_count + g_cfg.mig_count; i++) {
        if (g_cfg.gpu[i].mig_parent == dev + 1)
            used += atomic_load(&g_sim.st->gpu[i].used);
    }
    return used;
}

/* A GPU in MIG mode: SUCCESS; NOT_SUPPORTED for a GPU that cannot or is not
 * in MIG mode; the lookup's error for a bad or MIG device handle. */
static nvmlReturn_t lookup_mig_gpu(nvmlDevice_t device, unsigned int *gpu)
{
    nvmlReturn_t rc = lookup(device, gpu);
    return rc == NVML_SUCCESS && !g_cfg.gpu[*gpu].mig_mode ? NVML_ERROR_NOT_SUPPORTED : rc;
}

static nvmlReturn_t lookup_mig_device(nvmlDevice_t device, unsigned int *dev)
{
    nvmlReturn_t rc = lookup_any(device, dev);
    return rc == NVML_SUCCESS && !is_mig(*dev) ? NVML_ERROR_NOT_SUPPORTED : rc;
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
     * answers; only the 80 GiB shape can be booted in MIG mode (simmig.h). */
    *currentMode = *pendingMode = g_cfg.gpu[g].mig_mode ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_any(device, &d);
    if (rc == NVML_SUCCESS && isMigDevice == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *isMigDevice = is_mig(d);
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
        *count = g_cfg.gpu[g].mig_mode ? SIM_MIG_COMPUTE_SLICES : 0;
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
    for (unsigned int i = g_cfg.gpu_count; i < g_cfg.gpu_count + g_cfg.mig_count; i++) {
        if (g_cfg.gpu[i].mig_parent == g + 1 && sim_mig_ordinal(&g_cfg, i) == index) {
            *migDevice = &g_dev[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_any(migDevice, &d);
    if (rc != NVML_SUCCESS)
        return rc;
    if (device == NULL || !is_mig(d))
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_dev[parent_of(d)];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_mig_device(device, &d);
    if (rc == NVML_SUCCESS && id == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *id = g_cfg.gpu[d].gi_id;
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_mig_device(device, &d);
    if (rc == NVML_SUCCESS && id == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *id = g_cfg.gpu[d].ci_id;
    return rc;
}

/* A GPU reports itself as one whole instance; a MIG device its profile. */
NVML_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_any(device, &d);
    if (rc != NVML_SUCCESS)
        return rc;
    if (attributes == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_gpu_config *g = &g_cfg.gpu[d];
    const struct sim_mig_profile *p = is_mig(d) ? sim_mig_by_index(g->mig_profile) : NULL;
    *attributes = (nvmlDeviceAttributes_t){
        .multiprocessorCount = g->sm_count,
        .sharedCopyEngineCount = p ? p->copy_engines : 3,
        .sharedDecoderCount = p ? p->decoders : 0,
        .sharedEncoderCount = p ? p->encoders : 0,
        .sharedJpegCount = p ? p->jpegs : 0,
        .sharedOfaCount = p ? p->ofas : 0,
        .gpuInstanceSliceCount = p ? p->slices : 7,
        .computeInstanceSliceCount = p ? p->slices : 7,
        .memorySizeMB = g->total_mem >> 20,
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
    for (unsigned int i = g_cfg.gpu_count; i < g_cfg.gpu_count + g_cfg.mig_count; i++) {
        if (g_cfg.gpu[i].mig_parent == g + 1 && g_cfg.gpu[i].mig_profile == p->index && n < p->instance_count)
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
    for (unsigned int i = g_cfg.gpu_count; i < g_cfg.gpu_count + g_cfg.mig_count; i++) {
        if (g_cfg.gpu[i].mig_parent == g + 1 && g_cfg.gpu[i].gi_id == id) {
            *gpuInstance = &g_gi[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* The MIG device behind a GPU instance handle; INVALID_ARGUMENT for
 * anything else. */
static nvmlReturn_t lookup_gi(nvmlGpuInstance_t gi, const void *out, unsigned int *dev)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned int i = g_cfg.gpu_count; i < g_cfg.gpu_count + g_cfg.mig_count; i++) {
        if (gi == &g_gi[i]) {
            *dev = i;
            return out == NULL ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_gi(gpuInstance, info, &d);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_gpu_config *m = &g_cfg.gpu[d];
    const struct sim_mig_profile *p = sim_mig_by_index(m->mig_profile);
    *info = (nvmlGpuInstanceInfo_t){
        .device = &g_dev[parent_of(d)],
        .id = m->gi_id,
        .profileId = p ? p->id : 0,
        .placement = {m->gi_start, p ? p->memory_slices : 0},
    };
    return NVML_SUCCESS;
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
                               nvmlComputeInstanceProfileInfo_t *out)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_gi(gi, info, &d);
    if (rc != NVML_SUCCESS)
        return rc;
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *p = sim_mig_by_index(g_cfg.gpu[d].mig_profile);
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
    nvmlReturn_t rc = ci_profile(gpuInstance, profile, engProfile, info, &base);
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
    nvmlReturn_t rc = ci_profile(gpuInstance, profile, engProfile, info, &b);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned int version = info->version;
    unsigned int d = ((struct nvmlGpuInstance_st *)gpuInstance)->dev;
    const struct sim_mig_profile *p = sim_mig_by_index(g_cfg.gpu[d].mig_profile);
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
    nvmlReturn_t rc = lookup_gi(gpuInstance, computeInstances, &d);
    if (rc != NVML_SUCCESS)
        return rc;
    if (count == NULL || profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *p = sim_mig_by_index(g_cfg.gpu[d].mig_profile);
    *count = 0;
    if (p && p->ci_index == profileId)
        computeInstances[(*count)++] = &g_ci[d];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                               nvmlComputeInstance_t *computeInstance)
{
    unsigned int d;
    nvmlReturn_t rc = lookup_gi(gpuInstance, computeInstance, &d);
    if (rc != NVML_SUCCESS)
        return rc;
    if (g_cfg.gpu[d].ci_id != id)
        return NVML_ERROR_NOT_FOUND;
    *computeInstance = &g_ci[d];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                       nvmlComputeInstanceInfo_t *info)
{
    if (!ready())
        return NVML_ERROR_UNINITIALIZED;
    for (unsigned int i = g_cfg.gpu_count; i < g_cfg.gpu_count + g_cfg.mig_count; i++) {
        if (computeInstance != &g_ci[i])
            continue;
        if (info == NULL)
            return NVML_ERROR_INVALID_ARGUMENT;
        const struct sim_mig_profile *p = sim_mig_by_index(g_cfg.gpu[i].mig_profile);
        *info = (nvmlComputeInstanceInfo_t){
            .device = &g_dev[parent_of(i)],
            .gpuInstance = &g_gi[i],
            .id = g_cfg.gpu[i].ci_id,
            .profileId = p ? p->ci_index : 0,
            .placement = {0, p ? p->slices : 0},
        };
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* The first version took the same struct. */
NVML_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                                    nvmlComputeInstanceInfo_t *info)
    __attribute__((alias("nvmlComputeInstanceGetInfo_v2")));
