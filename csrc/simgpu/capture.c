/* Simulated libcuda.so.1: stream capture. Between cuStreamBeginCapture and
 * cuStreamEndCapture a stream's kernel launches become kernel nodes of a
 * graph, in the order launched, instead of device time (driver_exec.c asks
 * sim_capture_launch first); the graph then runs as any other. What is
 * modelled: capture of kernels on one created stream at a time per stream,
 * the capture status and id, the thread's capture mode. Not modelled:
 * other work queued while capturing (copies, fills, event records run at
 * once), joining other streams into a capture through events, and the
 * checks the capture modes impose on other threads' calls. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "driver.h"

struct capture {
    struct sim_stream *stream;
    CUgraph graph;
    CUgraphNode last;             /* the node the next one depends on */
    cuuint64_t id;
    CUstreamCaptureMode mode;
    struct capture *next;
};

static struct {
    pthread_mutex_t lock;
    struct capture *head;
    cuuint64_t next_id;
} captures = {PTHREAD_MUTEX_INITIALIZER, NULL, 1};

static _Thread_local CUstreamCaptureMode thread_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

/* Caller holds captures.lock. */
static struct capture **capture_at(const struct sim_stream *s)
{
    struct capture **c = &captures.head;
    while (*c && (*c)->stream != s)
        c = &(*c)->next;
    return c;
}

/* Unlinks and returns the stream's capture, or NULL; the caller frees it. */
static struct capture *capture_take(const struct sim_stream *s)
{
    pthread_mutex_lock(&captures.lock);
    struct capture **at = capture_at(s), *c = *at;
    if (c)
        *at = c->next;
    pthread_mutex_unlock(&captures.lock);
    return c;
}

CUresult sim_capture_begin(CUstream h, CUstreamCaptureMode mode, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream_args(h, per_thread, &s, (unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED);
    if (rc)
        return rc;
    /* The legacy stream synchronises with every other: it cannot be captured. */
    if (s == &s->ctx->legacy)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct capture *c = calloc(1, sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUcontext prev = NULL;
    bool pushed = (CUcontext)sim_current_ctx() != (CUcontext)s->ctx;
    if (pushed && (rc = cuCtxPushCurrent_v2((CUcontext)s->ctx))) {
        free(c);
        return rc;
    }
    rc = cuGraphCreate(&c->graph, 0);
    if (pushed)
        cuCtxPopCurrent_v2(&prev);
    if (rc) {
        free(c);
        return rc;
    }
    pthread_mutex_lock(&captures.lock);
    if (*capture_at(s)) {
        rc = CUDA_ERROR_ILLEGAL_STATE;
    } else {
        *c = (struct capture){.stream = s, .graph = c->graph, .id = captures.next_id++, .mode = mode,
                              .next = captures.head};
        captures.head = c;
    }
    pthread_mutex_unlock(&captures.lock);
    if (rc) {
        cuGraphDestroy(c->graph);
        free(c);
    }
    return rc;
}

CUresult sim_capture_end(CUstream h, CUgraph *phGraph, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream_args(h, per_thread, &s, !phGraph);
    if (rc)
        return rc;
    struct capture *c = capture_take(s);
    if (!c)
        return CUDA_ERROR_ILLEGAL_STATE;
    *phGraph = c->graph;
    free(c);
    return CUDA_SUCCESS;
}

/* A stream destroyed while capturing ends its capture (the graph goes), so
 * that a stream made later at the same address does not inherit it. */
void sim_capture_forget(const struct sim_stream *s)
{
    struct capture *c = capture_take(s);
    if (c) {
        cuGraphDestroy(c->graph);
        free(c);
    }
}

CUstreamCaptureStatus sim_capture_status(const struct sim_stream *s)
{
    pthread_mutex_lock(&captures.lock);
    bool active = *capture_at(s) != NULL;
    pthread_mutex_unlock(&captures.lock);
    return active ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
}

CUresult sim_capture_is_active(CUstream h, bool per_thread, CUstreamCaptureStatus *status)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream_args(h, per_thread, &s, !status);
    if (rc)
        return rc;
    *status = sim_capture_status(s);
    return CUDA_SUCCESS;
}

/* Status, id, graph and the nodes the next captured node will depend on
 * (the last one captured); the dependency array lives until the next
 * capture call on the stream, as the driver's does. */
CUresult sim_capture_info(CUstream h, bool per_thread, CUstreamCaptureStatus *status, cuuint64_t *id, CUgraph *graph,
                          const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream_args(h, per_thread, &s, !status);
    if (rc)
        return rc;
    pthread_mutex_lock(&captures.lock);
    struct capture *c = *capture_at(s);
    *status = c ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    if (c && id)
        *id = c->id;
    if (c && graph)
        *graph = c->graph;
    if (c && deps)
        *deps = c->last ? &c->last : NULL;
    if (c && edges)
        *edges = NULL;
    if (c && ndeps)
        *ndeps = c->last ? 1 : 0;
    pthread_mutex_unlock(&captures.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    if (!mode || (unsigned)*mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = thread_mode;
    thread_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* A launch on a capturing stream: a kernel node after the last one. Its
 * parameters are read now, as the driver copies them when capturing.
 * *captured is false when the stream is not capturing. */
CUresult sim_capture_launch(struct sim_stream *s, CUfunction f, const unsigned grid[3], const unsigned block[3],
                            void **params, void **extra, bool *captured)
{
    *captured = false;
    pthread_mutex_lock(&captures.lock);
    struct capture *c = *capture_at(s);
    CUresult rc = CUDA_SUCCESS;
    if (c) {
        CUDA_KERNEL_NODE_PARAMS p = {.func = f,
                                     .gridDimX = grid[0], .gridDimY = grid[1], .gridDimZ = grid[2],
                                     .blockDimX = block[0], .blockDimY = block[1], .blockDimZ = block[2],
                                     .kernelParams = params, .extra = extra};
        CUgraphNode node;
        rc = cuGraphAddKernelNode_v2(&node, c->graph, c->last ? &c->last : NULL, c->last ? 1 : 0, &p);
        if (!rc)
            c->last = node;
        *captured = true;
    }
    pthread_mutex_unlock(&captures.lock);
    return rc;
}
