/* MIG of the simulated GPUs: the GPU instance profiles of an H100 80GB and
 * where each may sit, shared by the configuration (which lays instances
 * out) and NVML (which reports them). Facts and sources:
 * docs/simulated-gpu.md, "MIG".
 *
 * A MIG device is a device of the simulation like a GPU: it has its own
 * entry in sim_config.gpu[] after the physical GPUs (mig_parent says whose),
 * its own memory counter and device timeline, as a real GPU instance has its
 * own memory slices and SMs. Thread-safety: the table is constant. */
#ifndef CGPU_SIMMIG_H
#define CGPU_SIMMIG_H

#include <stdbool.h>
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

/* Lay out the instances of `profiles` (comma-separated names, or "on" for
 * none) on physical GPU `gpu` of cfg: each takes the first free placement
 * its profile allows, as `nvidia-smi mig -cgi` does, and becomes a MIG
 * device entry appended after cfg->gpu_count + cfg->mig_count. 0, or -1
 * with a message. */
int sim_mig_layout(struct sim_config *cfg, unsigned int gpu, const char *profiles, char *err, size_t errlen);

/* Index of the MIG device entry `dev` in its parent's order (0, 1, ...). */
unsigned int sim_mig_ordinal(const struct sim_config *cfg, unsigned int dev);

#endif
