/* Simulated libcuda.so.1: host functions in stream order (cuLaunchHostFunc,
 * cuStreamAddCallback). */
#define _GNU_SOURCE
#include "driver.h"

/* A host function runs once the work queued before it on the stream is
 * done, and work queued after it waits for it. The simulation runs it in
 * the calling thread at that moment, so the call returns after the function
 * did (a real driver returns at once and runs it on its own thread): the
 * order is the driver's, only the caller waits longer. A capturing stream
 * would need a host node, which the simulation's capture does not make. */
static CUresult host_func(CUstream h, bool per_thread, CUhostFn fn, CUstreamCallback cb, void *data)
{
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult rc = sim_capture_is_active(h, per_thread, &capture);
    if (rc)
        return rc;
    if (capture != CU_STREAM_CAPTURE_STATUS_NONE)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct sim_stream *s;
    if ((rc = sim_copy_stream(h, per_thread, true, &s)))
        return rc;
    if (fn)
        fn(data);
    else
        cb(h, CUDA_SUCCESS, data);
    return CUDA_SUCCESS;
}

CUresult sim_launch_host(CUstream h, bool per_thread, CUhostFn fn, void *data)
{
    return fn ? host_func(h, per_thread, fn, NULL, data) : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_add_callback(CUstream h, bool per_thread, CUstreamCallback cb, void *data, unsigned flags)
{
    return cb && flags == 0 ? host_func(h, per_thread, NULL, cb, data) : CUDA_ERROR_INVALID_VALUE;
}
