/* MIG of the simulated GPUs: the GPU instance profiles of an H100 80GB and
 * where each may sit, shared by the configuration (which lays instances
 * out) and NVML (which reports them). Facts and sources:
 * docs/simulated-gpu.md, "MIG".
 *
 * A MIG device is a device of the simulation like a GPU: it has its own
 * entry in sim_config.gpu[] after the physical GPUs (mig_parent says whose;
 * NVML takes and frees entries at run time, see sim_mig_entry),
 * its own memory counter and device timeline, as a real GPU instance has its
 * own memory slices and SMs. Thread-safety: the table is constant. */
#ifndef CGPU_SIMMIG_H
#define CGPU_SIMMIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "simstate.h"

#define SIM_MIG_MEMORY_SLICES 8
#define SIM_MIG_COMPUTE_SLICES 7
#define SIM_MIG_MAX_PLACEMENTS 7

struct sim_mig_profile {
    const char *name;             /* "1g.10gb", as NVML names it after "MIG " */
    unsigned int index;           /* NVML_GPU_INSTANCE_PROFILE_*: what ProfileInfo takes */
    unsigned int id;              /* the profile ID on an H100 80GB: what Create and Get*Instances take */
    unsigned int slices;          /* compute (GPU) slices */
    unsigned int memory_slices;   /* size of a placement */
    unsigned int instance_count;  /* how many fit on one GPU */
    unsigned int sms;
    unsigned int copy_engines, decoders, encoders, jpegs, ofas;
    unsigned long long memory_mib;
    unsigned int ci_index;        /* the full compute instance's NVML_COMPUTE_INSTANCE_PROFILE_* */
    unsigned int starts[SIM_MIG_MAX_PLACEMENTS]; /* memory slice each placement starts at */
    unsigned int placements;
};

extern const struct sim_mig_profile sim_mig_profiles[];
extern const unsigned int sim_mig_profile_count;

/* By name ("1g.10gb"), NVML profile index, or profile ID; NULL if none. */
const struct sim_mig_profile *sim_mig_by_name(const char *name);
const struct sim_mig_profile *sim_mig_by_index(unsigned int index);
const struct sim_mig_profile *sim_mig_by_id(unsigned int id);

/* The GPU instance ID a placement has (the driver's fixed numbering: 0 the
 * whole GPU, 1-2 the halves, 3-6 the quarters, 7-14 the eighths). */
unsigned int sim_mig_gi_id(unsigned int start, unsigned int memory_slices);

/* Whether a GPU has the shape the profiles are of (80 GiB, 132 SMs). */
bool sim_mig_capable(const struct sim_gpu_config *g);

/* A GPU instance entry's compute instance id before it has one. */
#define SIM_MIG_NO_CI 0xFFFFFFFFu

/* The MIG fields that change at run time, read and written atomically. */
static inline uint32_t sim_mig_load(const uint32_t *field)
{
    return __atomic_load_n(field, __ATOMIC_ACQUIRE);
}

static inline void sim_mig_store(uint32_t *field, uint32_t value)
{
    __atomic_store_n(field, value, __ATOMIC_RELEASE);
}

/* Entry `dev` (a GPU instance) copied whole while no one changed it:
 * false when it is free, out of range or kept changing. Entries are
 * changed only by taking a free one or freeing a taken one, and a free
 * one is never read, so a reader sees an entry whole or not at all. */
bool sim_mig_entry(const struct sim_config *cfg, unsigned int dev, struct sim_gpu_config *out);

/* A taken entry that is a MIG device: it has its compute instance. */
static inline bool sim_mig_is_device(const struct sim_gpu_config *m)
{
    return m->mig_parent != 0 && m->ci_id != SIM_MIG_NO_CI;
}

/* Lay out the instances of `profiles` (comma-separated names, or "on" for
 * none) on physical GPU `gpu` of cfg: each takes the first free placement
 * its profile allows, as `nvidia-smi mig -cgi` does, with one compute
 * instance over all of it (-C). 0, or -1 with a message. At load only. */
int sim_mig_layout(struct sim_config *cfg, unsigned int gpu, const char *profiles, char *err, size_t errlen);

/* Index of MIG device `dev` among its GPU's MIG devices (0, 1, ...). */
unsigned int sim_mig_ordinal(const struct sim_config *cfg, unsigned int dev);

/* Changes of the layout at run time (NVML's), each under the state's MIG
 * lock (an OFD lock: a process killed while it holds it holds nothing). */
enum sim_mig_rc {
    SIM_MIG_OK,
    SIM_MIG_NOT_SUPPORTED, /* no MIG on this GPU, or not in MIG mode */
    SIM_MIG_IN_USE,        /* a process uses it, or it has instances */
    SIM_MIG_NO_ROOM,       /* no free placement (or compute slices, or entries) */
    SIM_MIG_BUSY,          /* another process held the MIG lock past the wait */
    SIM_MIG_INVALID,       /* a placement the profile does not have */
};

enum sim_mig_rc sim_mig_set_mode(struct sim_handle *h, unsigned int gpu, bool enable);
/* start < 0: the first free placement. */
enum sim_mig_rc sim_mig_create_gi(struct sim_handle *h, unsigned int gpu, const struct sim_mig_profile *p, int start,
                                  unsigned int *dev);
enum sim_mig_rc sim_mig_destroy_gi(struct sim_handle *h, unsigned int dev);
/* The compute instance over the whole GPU instance (the only one modelled). */
enum sim_mig_rc sim_mig_create_ci(struct sim_handle *h, unsigned int dev);
enum sim_mig_rc sim_mig_destroy_ci(struct sim_handle *h, unsigned int dev);

/* How many more GPU instances of `p` fit on GPU `gpu` now. */
unsigned int sim_mig_remaining(const struct sim_config *cfg, unsigned int gpu, const struct sim_mig_profile *p);

#endif
