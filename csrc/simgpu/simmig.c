/* MIG profiles of the simulated H100 80GB and the layout of a GPU's
 * instances from the configuration (simmig.h). */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>

#include "simmig.h"

/* `nvidia-smi mig -lgip` on an H100 80GB HBM3 (memory GiB x 1024 = MiB,
 * SMs, engines) and the NVML profile indexes of nvml.h; placements as
 * `nvidia-smi mig -lgipp` lists them. NVML_GPU_INSTANCE_PROFILE_*:
 * 1_SLICE 0, 2_SLICE 1, 3_SLICE 2, 4_SLICE 3, 7_SLICE 4, 1_SLICE_REV1 7,
 * 1_SLICE_REV2 9; NVML_COMPUTE_INSTANCE_PROFILE_*: 1_SLICE 0, 2_SLICE 1,
 * 3_SLICE 2, 4_SLICE 3, 7_SLICE 4. */
const struct sim_mig_profile sim_mig_profiles[] = {
    {"1g.10gb", 0, 19, 1, 1, 7, 16, 1, 1, 0, 1, 0, 9984, 0, {0, 1, 2, 3, 4, 5, 6}, 7},
    {"1g.10gb+me", 7, 20, 1, 1, 1, 16, 1, 1, 0, 1, 1, 9984, 0, {0, 1, 2, 3, 4, 5, 6}, 7},
    {"1g.20gb", 9, 15, 1, 2, 4, 26, 1, 1, 0, 1, 0, 20096, 0, {0, 2, 4, 6}, 4},
    {"2g.20gb", 1, 14, 2, 2, 3, 32, 2, 2, 0, 2, 0, 20096, 1, {0, 2, 4}, 3},
    {"3g.40gb", 2, 9, 3, 4, 2, 60, 3, 3, 0, 3, 0, 40448, 2, {0, 4}, 2},
    {"4g.40gb", 3, 5, 4, 4, 1, 64, 4, 4, 0, 4, 0, 40448, 3, {0}, 1},
    {"7g.80gb", 4, 0, 7, 8, 1, 132, 8, 7, 0, 7, 1, 81152, 4, {0}, 1},
};
const unsigned int sim_mig_profile_count = sizeof(sim_mig_profiles) / sizeof(sim_mig_profiles[0]);

const struct sim_mig_profile *sim_mig_by_name(const char *name)
{
    for (unsigned int i = 0; i < sim_mig_profile_count; i++) {
        if (strcmp(sim_mig_profiles[i].name, name) == 0)
            return &sim_mig_profiles[i];
    }
    return NULL;
}

const struct sim_mig_profile *sim_mig_by_index(unsigned int index)
{
    for (unsigned int i = 0; i < sim_mig_profile_count; i++) {
        if (sim_mig_profiles[i].index == index)
            return &sim_mig_profiles[i];
    }
    return NULL;
}

const struct sim_mig_profile *sim_mig_by_id(unsigned int id)
{
    for (unsigned int i = 0; i < sim_mig_profile_count; i++) {
        if (sim_mig_profiles[i].id == id)
            return &sim_mig_profiles[i];
    }
    return NULL;
}

unsigned int sim_mig_gi_id(unsigned int start, unsigned int memory_slices)
{
    switch (memory_slices) {
    case 8: return 0;
    case 4: return 1 + start / 4;
    case 2: return 3 + start / 2;
    default: return 7 + start;
    }
}

bool sim_mig_capable(const struct sim_gpu_config *g)
{
    return g->mig_parent == 0 && g->total_mem == 80ULL << 30 && g->sm_count == 132;
}

/* Memory slices taken on GPU `gpu` by the MIG devices laid out so far. */
static unsigned int slices_taken(const struct sim_config *cfg, unsigned int gpu)
{
    unsigned int taken = 0;
    for (unsigned int d = cfg->gpu_count; d < cfg->gpu_count + cfg->mig_count; d++) {
        const struct sim_gpu_config *m = &cfg->gpu[d];
        if (m->mig_parent != gpu + 1)
            continue;
        const struct sim_mig_profile *p = sim_mig_by_index(m->mig_profile);
        for (unsigned int s = 0; p && s < p->memory_slices; s++)
            taken |= 1u << (m->gi_start + s);
    }
    return taken;
}

static int add_instance(struct sim_config *cfg, unsigned int gpu, const struct sim_mig_profile *p, char *err,
                        size_t errlen)
{
    unsigned int taken = slices_taken(cfg, gpu), start = 0;
    bool found = false;
    for (unsigned int i = 0; i < p->placements && !found; i++) {
        unsigned int want = ((1u << p->memory_slices) - 1u) << p->starts[i];
        if ((taken & want) == 0) {
            start = p->starts[i];
            found = true;
        }
    }
    /* A 7g takes the seven compute slices: nothing else fits beside it,
     * nor beside a 4g more than a 3g, as the compute slices run out. */
    unsigned int compute = 0;
    for (unsigned int d = cfg->gpu_count; d < cfg->gpu_count + cfg->mig_count; d++) {
        const struct sim_mig_profile *q = sim_mig_by_index(cfg->gpu[d].mig_profile);
        if (cfg->gpu[d].mig_parent == gpu + 1 && q)
            compute += q->slices;
    }
    if (!found || compute + p->slices > SIM_MIG_COMPUTE_SLICES) {
        snprintf(err, errlen, "no room for a %s instance on GPU %u beside the instances before it", p->name, gpu);
        return -1;
    }
    unsigned int dev = cfg->gpu_count + cfg->mig_count;
    if (dev >= SIM_MAX_GPUS) {
        snprintf(err, errlen, "more than %d GPUs and MIG devices in all", SIM_MAX_GPUS);
        return -1;
    }
    const struct sim_gpu_config copy = cfg->gpu[gpu], *parent = &copy; /* m is in the same array */
    struct sim_gpu_config *m = &cfg->gpu[dev];
    memset(m, 0, sizeof(*m));
    unsigned int gi = sim_mig_gi_id(start, p->memory_slices);
    snprintf(m->name, sizeof(m->name), "%.60s MIG %s", parent->name, p->name);
    /* The driver's MIG UUIDs are random-looking; these are distinct per
     * GPU and instance. */
    snprintf(m->uuid, sizeof(m->uuid), "MIG-5c1a%04x-0000-4000-8000-%012x", gpu, 0xa10000u + gi);
    memcpy(m->pci_bus_id, parent->pci_bus_id, sizeof(m->pci_bus_id));
    m->total_mem = p->memory_mib << 20;
    m->sm_count = p->sms;
    m->cc_major = parent->cc_major;
    m->cc_minor = parent->cc_minor;
    m->pci_domain = parent->pci_domain;
    m->pci_bus = parent->pci_bus;
    m->pci_device = parent->pci_device;
    m->pci_device_id = parent->pci_device_id;
    m->minor_number = parent->minor_number;
    m->mig_parent = gpu + 1;
    m->mig_profile = p->index;
    m->gi_id = gi;
    m->ci_id = 0;
    m->gi_start = start;
    cfg->mig_count++;
    return 0;
}

int sim_mig_layout(struct sim_config *cfg, unsigned int gpu, const char *profiles, char *err, size_t errlen)
{
    if (!sim_mig_capable(&cfg->gpu[gpu])) {
        snprintf(err, errlen, "GPU %u: MIG is simulated for the H100 80GB shape only (mem=80GiB sms=132)", gpu);
        return -1;
    }
    cfg->gpu[gpu].mig_mode = 1;
    if (strcmp(profiles, "on") == 0)
        return 0;
    char buf[256];
    if (snprintf(buf, sizeof(buf), "%s", profiles) >= (int)sizeof(buf)) {
        snprintf(err, errlen, "GPU %u: mig= list too long", gpu);
        return -1;
    }
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        const struct sim_mig_profile *p = sim_mig_by_name(t);
        if (p == NULL) {
            snprintf(err, errlen, "GPU %u: unknown MIG profile %.40s (1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, "
                     "4g.40gb, 7g.80gb)", gpu, t);
            return -1;
        }
        if (add_instance(cfg, gpu, p, err, errlen) != 0)
            return -1;
    }
    return 0;
}

unsigned int sim_mig_ordinal(const struct sim_config *cfg, unsigned int dev)
{
    unsigned int n = 0;
    for (unsigned int d = cfg->gpu_count; d < dev; d++)
        n += cfg->gpu[d].mig_parent == cfg->gpu[dev].mig_parent;
    return n;
}
