/* What the simulated libnvidia-ml.so.1's files share (nvml.c, nvml_mig.c):
 * the process's view of the simulation and the handle checks every query
 * opens with. Ownership and thread-safety as nvml.c says. */
#ifndef CGPU_NVML_INTERNAL_H
#define CGPU_NVML_INTERNAL_H

#include <stdbool.h>

#include "cgpu/nvml_abi.h"
#include "simstate.h"

#define NVML_EXPORT __attribute__((visibility("default")))

/* A device handle: an index into the configuration's devices, the GPUs
 * first, then the MIG devices. */
struct nvmlDevice_st {
    unsigned int index;
};

extern struct sim_handle g_sim;
/* A private copy with terminated strings, taken at the first init. */
extern struct sim_config g_cfg;
extern struct nvmlDevice_st g_dev[SIM_MAX_GPUS];

bool ready(void);
/* A handle of a physical GPU (MIG device handles are INVALID_ARGUMENT), its
 * index in *gpu; GPU_IS_LOST for a GPU off the bus. */
nvmlReturn_t lookup(nvmlDevice_t device, unsigned int *gpu);
/* lookup() for a query that writes through `out`. */
nvmlReturn_t lookup_out(nvmlDevice_t device, const void *out, unsigned int *gpu);
nvmlReturn_t give_handle(unsigned int i, nvmlDevice_t *device);
nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src);
void reap_dead(void);

/* nvml_mig.c. The MIG layout changes at run time (NVML's own calls, in
 * any process): it is read from the shared state, never from g_cfg.
 * dev_view: device `dev` as it is now (a GPU: g_cfg's with its MIG mode
 * now; a GPU instance: its entry), strings terminated; false for a free
 * entry. lookup_any: a handle of a GPU or of a MIG device (a GPU instance
 * with its compute instance); its index and, if `view`, its view. */
bool dev_view(unsigned int dev, struct sim_gpu_config *out);
nvmlReturn_t lookup_any(nvmlDevice_t device, unsigned int *dev, struct sim_gpu_config *view);
/* Bytes used on device `dev`: a GPU in MIG mode counts its MIG devices'. */
unsigned long long mig_used_bytes(unsigned int dev);

#endif
