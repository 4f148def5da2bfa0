/* libcgpu.so: kernel launches. This is where the compute scheduler's grant
 * will be checked; with no compute limit a launch costs one load of the
 * cached driver pointer and a call. */
#include "libcgpu.h"

#define FORWARD(symbol, ...)                                                                    \
    do {                                                                                        \
        __typeof__(&symbol) real_ = REAL(symbol);                                               \
        return real_ ? real_(__VA_ARGS__) : CUDA_ERROR_NOT_INITIALIZED;                         \
    } while (0)

#define LAUNCH_HOOK(symbol)                                                                     \
    CGPU_EXPORT CUresult symbol(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
                                unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, void **params, \
                                void **extra)                                                   \
    {                                                                                           \
        FORWARD(symbol, f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);                     \
    }

LAUNCH_HOOK(cuLaunchKernel)
LAUNCH_HOOK(cuLaunchKernel_ptsz)

CGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    FORWARD(cuLaunchKernelEx, config, f, kernelParams, extra);
}

CGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                           void **extra)
{
    FORWARD(cuLaunchKernelEx_ptsz, config, f, kernelParams, extra);
}

#define COOPERATIVE_HOOK(symbol)                                                                \
    CGPU_EXPORT CUresult symbol(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
                                unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, void **params) \
    {                                                                                           \
        FORWARD(symbol, f, gx, gy, gz, bx, by, bz, shmem, s, params);                            \
    }

COOPERATIVE_HOOK(cuLaunchCooperativeKernel)
COOPERATIVE_HOOK(cuLaunchCooperativeKernel_ptsz)

CGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    FORWARD(cuGraphLaunch, hGraphExec, hStream);
}

CGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    FORWARD(cuGraphLaunch_ptsz, hGraphExec, hStream);
}
