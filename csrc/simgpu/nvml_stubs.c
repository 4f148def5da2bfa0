/* The entry points of NVIDIA's nvml.h the simulation does not model
 * (nvml_unmodelled.def, generated from the header): each answers
 * NVML_ERROR_NOT_SUPPORTED, what a real driver answers for a feature the GPU
 * lacks, so a tool that probes it shows "N/A" where a missing symbol would
 * make it fail with FunctionNotFound.
 *
 * Built against our nvml_abi.h, which lacks most of these parameter types,
 * a stub takes no parameters: it reads none of the caller's arguments, and
 * the calling convention leaves them to the caller. Built against NVIDIA's
 * nvml.h (-DCGPU_USE_REAL_NVML_H, tests/abi) each takes the header's own
 * parameters, so the generated list is checked against its prototypes. */
#include "cgpu/nvml_abi.h"

#define NVML_EXPORT __attribute__((visibility("default")))

#ifdef CGPU_USE_REAL_NVML_H
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define NVML_STUB(symbol, params)                     \
    NVML_EXPORT nvmlReturn_t DECLDIR symbol params     \
    {                                                 \
        return NVML_ERROR_NOT_SUPPORTED;              \
    }
#else
#define NVML_STUB(symbol, params)                     \
    NVML_EXPORT nvmlReturn_t symbol(void);            \
    nvmlReturn_t symbol(void)                         \
    {                                                 \
        return NVML_ERROR_NOT_SUPPORTED;              \
    }
#endif

#include "nvml_unmodelled.def"
