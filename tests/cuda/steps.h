/* What the step programs (runtime_steps.c, spin.cu) share: the host clock
 * they time steps by and the launch of a graph they built. C and C++; a C
 * file defines _POSIX_C_SOURCE before including it. Header only. */
#ifndef CGPU_TEST_STEPS_H
#define CGPU_TEST_STEPS_H

#include <time.h>
#include <cuda_runtime_api.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Unless rc is already a failure: instantiates g and launches it once on
 * `st`, waiting for it to finish; *us is how long that launch took. */
static cudaError_t launch_graph_once(cudaError_t rc, cudaGraph_t g, cudaStream_t st, unsigned long long *us)
{
    cudaGraphExec_t x;
    if (!rc)
        rc = cudaGraphInstantiate(&x, g, 0);
    double t0 = now_s();
    if (!rc)
        rc = cudaGraphLaunch(x, st);
    if (!rc)
        rc = cudaStreamSynchronize(st);
    *us = (unsigned long long)((now_s() - t0) * 1e6);
    return rc;
}

#endif /* CGPU_TEST_STEPS_H */
