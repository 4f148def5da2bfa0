/* MIG profiles of the simulated H100 80GB and the layout of a GPU's
 * instances from the configuration (simmig.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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

bool sim_mig_entry(const struct sim_config *cfg, unsigned int dev, struct sim_gpu_config *out)
{
    if (dev < cfg->gpu_count || dev >= SIM_MAX_GPUS || dev >= cfg->gpu_count + sim_mig_load(&cfg->mig_count))
        return false;
    const struct sim_gpu_config *e = &cfg->gpu[dev];
    for (int tries = 0; tries < 8; tries++) {
        uint32_t gen = sim_mig_load(&e->mig_gen), parent = sim_mig_load(&e->mig_parent);
        if (parent == 0)
            return false;
        memcpy(out, e, sizeof(*out));
        out->ci_id = sim_mig_load(&e->ci_id);
        if (sim_mig_load(&e->mig_gen) == gen && sim_mig_load(&e->mig_parent) == parent)
            return true;
    }
    return false;
}

/* Memory slices and compute slices the instances of GPU `gpu` take. */
static void taken(const struct sim_config *cfg, unsigned int gpu, unsigned int *memory, unsigned int *compute)
{
    *memory = *compute = 0;
    for (unsigned int d = cfg->gpu_count; d < cfg->gpu_count + cfg->mig_count && d < SIM_MAX_GPUS; d++) {
        struct sim_gpu_config m;
        if (!sim_mig_entry(cfg, d, &m) || m.mig_parent != gpu + 1)
            continue;
        const struct sim_mig_profile *p = sim_mig_by_index(m.mig_profile);
        if (p == NULL)
            continue;
        *memory |= ((1u << p->memory_slices) - 1u) << m.gi_start;
        *compute += p->slices;
    }
}

/* The first free placement of `p` on GPU `gpu` (or `want`, if free), as
 * `nvidia-smi mig -cgi` picks; the compute slices must last too (a 4g
 * and a 3g fill them). */
static enum sim_mig_rc place(const struct sim_config *cfg, unsigned int gpu, const struct sim_mig_profile *p, int want,
                             unsigned int *start)
{
    unsigned int memory, compute;
    taken(cfg, gpu, &memory, &compute);
    bool known = want < 0;
    for (unsigned int i = 0; i < p->placements; i++) {
        unsigned int slices = ((1u << p->memory_slices) - 1u) << p->starts[i];
        if (want >= 0 && p->starts[i] != (unsigned int)want)
            continue;
        known = true;
        if ((memory & slices) == 0 && compute + p->slices <= SIM_MIG_COMPUTE_SLICES) {
            *start = p->starts[i];
            return SIM_MIG_OK;
        }
    }
    return known ? SIM_MIG_NO_ROOM : SIM_MIG_INVALID;
}

/* Takes a free entry for a GPU instance of `p` at `start` on `gpu`: its
 * fields first, then mig_count (if it is a new entry), then mig_parent,
 * which makes it taken. A writer killed half-way leaves a free entry. */
static enum sim_mig_rc take_entry(struct sim_config *cfg, unsigned int gpu, const struct sim_mig_profile *p,
                                  unsigned int start, uint32_t ci, uint32_t serial, unsigned int *dev)
{
    unsigned int count = sim_mig_load(&cfg->mig_count), d = cfg->gpu_count;
    while (d < cfg->gpu_count + count && sim_mig_load(&cfg->gpu[d].mig_parent) != 0)
        d++;
    if (d >= SIM_MAX_GPUS)
        return SIM_MIG_NO_ROOM;
    const struct sim_gpu_config copy = cfg->gpu[gpu], *parent = &copy; /* m is in the same array */
    struct sim_gpu_config *m = &cfg->gpu[d];
    uint32_t gen = sim_mig_load(&m->mig_gen);
    struct sim_gpu_config e;
    memset(&e, 0, sizeof(e));
    unsigned int gi = sim_mig_gi_id(start, p->memory_slices);
    snprintf(e.name, sizeof(e.name), "%.60s MIG %s", parent->name, p->name);
    /* The driver's MIG UUIDs are random-looking; these are distinct per
     * GPU, instance and creation. */
    snprintf(e.uuid, sizeof(e.uuid), "MIG-5c1a%04x-%04x-4000-8000-%012x", gpu, serial & 0xffffu, 0xa10000u + gi);
    memcpy(e.pci_bus_id, parent->pci_bus_id, sizeof(e.pci_bus_id));
    e.total_mem = p->memory_mib << 20;
    e.sm_count = p->sms;
    e.cc_major = parent->cc_major;
    e.cc_minor = parent->cc_minor;
    e.pci_domain = parent->pci_domain;
    e.pci_bus = parent->pci_bus;
    e.pci_device = parent->pci_device;
    e.pci_device_id = parent->pci_device_id;
    e.minor_number = parent->minor_number;
    e.mig_profile = p->index;
    e.gi_id = gi;
    e.ci_id = ci;
    e.gi_start = start;
    e.mig_gen = gen;
    memcpy(m, &e, sizeof(e)); /* still free: mig_parent is 0 */
    if (d == cfg->gpu_count + count)
        sim_mig_store(&cfg->mig_count, count + 1);
    sim_mig_store(&m->mig_gen, gen + 1);
    sim_mig_store(&m->mig_parent, gpu + 1);
    *dev = d;
    return SIM_MIG_OK;
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
        unsigned int start, dev;
        enum sim_mig_rc rc = place(cfg, gpu, p, -1, &start);
        if (rc == SIM_MIG_OK)
            rc = take_entry(cfg, gpu, p, start, 0, 0, &dev);
        if (rc != SIM_MIG_OK) {
            if (cfg->gpu_count + cfg->mig_count >= SIM_MAX_GPUS)
                snprintf(err, errlen, "more than %d GPUs and MIG devices in all", SIM_MAX_GPUS);
            else
                snprintf(err, errlen, "no room for a %s instance on GPU %u beside the instances before it", p->name,
                         gpu);
            return -1;
        }
    }
    return 0;
}

unsigned int sim_mig_ordinal(const struct sim_config *cfg, unsigned int dev)
{
    unsigned int n = 0;
    for (unsigned int d = cfg->gpu_count; d < dev; d++) {
        struct sim_gpu_config m;
        n += sim_mig_entry(cfg, d, &m) && sim_mig_is_device(&m) && m.mig_parent == cfg->gpu[dev].mig_parent;
    }
    return n;
}

unsigned int sim_mig_remaining(const struct sim_config *cfg, unsigned int gpu, const struct sim_mig_profile *p)
{
    unsigned int memory, compute, n = 0;
    taken(cfg, gpu, &memory, &compute);
    for (unsigned int i = 0; i < p->placements; i++) {
        unsigned int slices = ((1u << p->memory_slices) - 1u) << p->starts[i];
        if ((memory & slices) == 0 && compute + p->slices <= SIM_MIG_COMPUTE_SLICES) {
            memory |= slices;
            compute += p->slices;
            n++;
        }
    }
    return n;
}

/* ---- run-time changes ---------------------------------------------------------- */

/* Threads of one process share its OFD lock: they take turns here first. */
static pthread_mutex_t g_local = PTHREAD_MUTEX_INITIALIZER;

static bool lock_layout(struct sim_handle *h)
{
    pthread_mutex_lock(&g_local);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SIM_MIG_LOCK_OFFSET, .l_len = 1};
    for (int waited_ms = 0; waited_ms < 2000; waited_ms++) { /* a writer holds it for microseconds */
        if (fcntl(h->fd, F_OFD_SETLK, &fl) == 0)
            return true;
        if (errno != EAGAIN && errno != EACCES)
            break;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    pthread_mutex_unlock(&g_local);
    return false;
}

static void unlock_layout(struct sim_handle *h)
{
    struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = SIM_MIG_LOCK_OFFSET, .l_len = 1};
    (void)fcntl(h->fd, F_OFD_SETLK, &fl);
    pthread_mutex_unlock(&g_local);
}

/* Whether a live process has a context or memory on device `dev`. */
static bool device_in_use(struct sim_handle *h, unsigned int dev)
{
    sim_reap_dead(h);
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        const struct sim_proc_slot *s = &h->st->proc[i];
        if (atomic_load(&s->state) == SIM_SLOT_LIVE &&
            (((atomic_load(&s->gpu_mask) >> dev) & 1u) || atomic_load(&s->used[dev]) != 0))
            return true;
    }
    return false;
}

static bool has_instances(const struct sim_config *cfg, unsigned int gpu)
{
    for (unsigned int d = cfg->gpu_count; d < cfg->gpu_count + sim_mig_load(&cfg->mig_count); d++) {
        if (sim_mig_load(&cfg->gpu[d].mig_parent) == gpu + 1)
            return true;
    }
    return false;
}

enum sim_mig_rc sim_mig_set_mode(struct sim_handle *h, unsigned int gpu, bool enable)
{
    struct sim_config *cfg = &h->st->config;
    if (!sim_mig_capable(&cfg->gpu[gpu]))
        return SIM_MIG_NOT_SUPPORTED;
    if (!lock_layout(h))
        return SIM_MIG_BUSY;
    enum sim_mig_rc rc = SIM_MIG_OK;
    if (enable && !sim_mig_load(&cfg->gpu[gpu].mig_mode) && device_in_use(h, gpu))
        rc = SIM_MIG_IN_USE; /* the driver resets the GPU: it must be idle */
    else if (!enable && has_instances(cfg, gpu))
        rc = SIM_MIG_IN_USE;
    else
        sim_mig_store(&cfg->gpu[gpu].mig_mode, enable);
    unlock_layout(h);
    return rc;
}

enum sim_mig_rc sim_mig_create_gi(struct sim_handle *h, unsigned int gpu, const struct sim_mig_profile *p, int start,
                                  unsigned int *dev)
{
    struct sim_config *cfg = &h->st->config;
    if (!sim_mig_load(&cfg->gpu[gpu].mig_mode))
        return SIM_MIG_NOT_SUPPORTED;
    if (!lock_layout(h))
        return SIM_MIG_BUSY;
    unsigned int at;
    enum sim_mig_rc rc = place(cfg, gpu, p, start, &at);
    if (rc == SIM_MIG_OK)
        rc = take_entry(cfg, gpu, p, at, SIM_MIG_NO_CI, atomic_fetch_add(&h->st->mig_created, 1) + 1, dev);
    unlock_layout(h);
    return rc;
}

enum sim_mig_rc sim_mig_destroy_gi(struct sim_handle *h, unsigned int dev)
{
    struct sim_config *cfg = &h->st->config;
    if (!lock_layout(h))
        return SIM_MIG_BUSY;
    struct sim_gpu_config *m = &cfg->gpu[dev];
    enum sim_mig_rc rc = SIM_MIG_OK;
    if (sim_mig_load(&m->mig_parent) == 0)
        rc = SIM_MIG_INVALID;
    else if (sim_mig_load(&m->ci_id) != SIM_MIG_NO_CI)
        rc = SIM_MIG_IN_USE; /* its compute instances go first */
    else {
        sim_mig_store(&m->mig_parent, 0);
        sim_mig_store(&m->mig_gen, sim_mig_load(&m->mig_gen) + 1);
    }
    unlock_layout(h);
    return rc;
}

enum sim_mig_rc sim_mig_create_ci(struct sim_handle *h, unsigned int dev)
{
    struct sim_config *cfg = &h->st->config;
    if (!lock_layout(h))
        return SIM_MIG_BUSY;
    struct sim_gpu_config *m = &cfg->gpu[dev];
    enum sim_mig_rc rc = SIM_MIG_OK;
    if (sim_mig_load(&m->mig_parent) == 0)
        rc = SIM_MIG_INVALID;
    else if (sim_mig_load(&m->ci_id) != SIM_MIG_NO_CI)
        rc = SIM_MIG_NO_ROOM; /* the one compute instance over all its slices exists */
    else
        sim_mig_store(&m->ci_id, 0);
    unlock_layout(h);
    return rc;
}

enum sim_mig_rc sim_mig_destroy_ci(struct sim_handle *h, unsigned int dev)
{
    struct sim_config *cfg = &h->st->config;
    if (!lock_layout(h))
        return SIM_MIG_BUSY;
    struct sim_gpu_config *m = &cfg->gpu[dev];
    enum sim_mig_rc rc = SIM_MIG_OK;
    if (sim_mig_load(&m->mig_parent) == 0 || sim_mig_load(&m->ci_id) == SIM_MIG_NO_CI)
        rc = SIM_MIG_INVALID;
    else if (device_in_use(h, dev))
        rc = SIM_MIG_IN_USE;
    else
        sim_mig_store(&m->ci_id, SIM_MIG_NO_CI);
    unlock_layout(h);
    return rc;
}
