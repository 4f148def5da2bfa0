/* Simulated libcuda.so.1: what the CUDA runtime needs of module loading
 * beyond PTX text: the loading mode, fatbins (the form nvcc embeds code in)
 * and the library/kernel API that lazy loading goes through. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "driver.h"

/* As the real driver: CUDA_MODULE_LOADING=EAGER or LAZY, lazy by default
 * (CUDA 12.2 on). */
SIM_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    const char *env = getenv("CUDA_MODULE_LOADING");
    *mode = env && strcmp(env, "EAGER") == 0 ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}
