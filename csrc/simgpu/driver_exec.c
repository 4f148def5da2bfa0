/* Simulated libcuda.so.1: modules, streams, events, kernel launches and
 * graphs. A kernel takes device time on the shared timeline of its GPU
 * (simstate.c): one kernel at a time per GPU across all processes. */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

/* ---- modules ------------------------------------------------------------------- */

/* A kernel that reads %globaltimer and takes a u64 first parameter is the
 * portable "spin for N ns" kernel: the simulation charges it N ns, which is
 * what it does on a real GPU. Anything else costs default_kernel_ns. */
static bool entry_is_timed(const char *params, const char *body_start, const char *body_end)
{
    const char *first = strstr(params, ".param");
    if (!first || first > body_start)
        return false;
    first += strlen(".param");
    while (isspace((unsigned char)*first))
        first++;
    if (strncmp(first, ".u64", 4) != 0 && strncmp(first, ".b64", 4) != 0 && strncmp(first, ".s64", 4) != 0)
        return false;
    const char *t = strstr(body_start, "%globaltimer");
    return t && t < body_end;
}

/* Counts the entries of a PTX image and, when funcs is given, fills them. */
static int parse_ptx(const char *ptx, struct sim_function *funcs, int cap)
{
    int n = 0;
    for (const char *p = strstr(ptx, ".entry"); p; p = strstr(p + 6, ".entry")) {
        if (p > ptx && !isspace((unsigned char)p[-1]))
            continue;
        const char *name = p + 6;
        while (isspace((unsigned char)*name))
            name++;
        size_t len = 0;
        while (isalnum((unsigned char)name[len]) || name[len] == '_' || name[len] == '$')
            len++;
        const char *body = strchr(name, '{');
        if (len == 0 || !body)
            return -1;
        int depth = 0;
        const char *end = body;
        for (; *end; end++) {
            depth += *end == '{' ? 1 : *end == '}' ? -1 : 0;
            if (depth == 0)
                break;
        }
        if (depth != 0)
            return -1;
        if (funcs && n < cap) {
            struct sim_function *f = &funcs[n];
            f->magic = MAGIC_FUNC;
            f->timed = entry_is_timed(name + len, body, end);
            snprintf(f->name, sizeof(f->name), "%.*s", (int)(len < sizeof(f->name) ? len : sizeof(f->name) - 1), name);
        }
        n++;
    }
    return n;
}

SIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !module || !image);
    if (rc)
        return rc;
    const char *ptx = image;
    /* Only PTX text: machine code (ELF cubins, fatbins) cannot run on the
     * simulated device, as sm_XX code cannot on a GPU of another arch. */
    if (!strstr(ptx, ".version") || !strstr(ptx, ".target"))
        return CUDA_ERROR_NO_BINARY_FOR_GPU;
    int n = parse_ptx(ptx, NULL, 0);
    if (n < 0)
        return CUDA_ERROR_INVALID_PTX;
    struct sim_module *m = calloc(1, sizeof(*m));
    struct sim_function *funcs = calloc((size_t)(n ? n : 1), sizeof(*funcs));
    if (!m || !funcs) {
        free(m);
        free(funcs);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    parse_ptx(ptx, funcs, n);
    for (int i = 0; i < n; i++)
        funcs[i].module = m;
    *m = (struct sim_module){.magic = MAGIC_MODULE, .dev = ctx->dev, .nfunc = n, .funcs = funcs};
    *module = (CUmodule)m;
    return CUDA_SUCCESS;
}

SIM_HANDLE_GET(module_get, CUmodule, struct sim_module, MAGIC_MODULE, CUDA_ERROR_INVALID_HANDLE)

SIM_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    struct sim_module *m;
    CUresult rc = module_get(hmod, &m);
    if (rc)
        return rc;
    for (int i = 0; i < m->nfunc; i++)
        m->funcs[i].magic = MAGIC_DEAD;
    m->magic = MAGIC_DEAD;
    free(m->funcs);
    free(m);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    struct sim_module *m;
    CUresult rc = module_get(hmod, &m);
    if (rc)
        return rc;
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < m->nfunc; i++) {
        if (strcmp(m->funcs[i].name, name) == 0) {
            *hfunc = (CUfunction)&m->funcs[i];
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

/* ---- streams ------------------------------------------------------------------- */

/* capture.c: whether a stream is capturing, its capture ended when it is
 * destroyed, and a launch made a node of its graph instead of device time. */
CUstreamCaptureStatus sim_capture_status(const struct sim_stream *s);
void sim_capture_forget(const struct sim_stream *s);
CUresult sim_capture_launch(struct sim_stream *s, CUfunction f, const unsigned grid[3], const unsigned block[3],
                            void **params, void **extra, bool *captured);

#define PER_THREAD_SLOTS 8
static _Thread_local struct sim_stream per_thread_stream[PER_THREAD_SLOTS];

static struct sim_stream *per_thread_of(struct sim_ctx *ctx)
{
    for (int i = 0; i < PER_THREAD_SLOTS; i++) {
        struct sim_stream *s = &per_thread_stream[i];
        if (s->ctx == ctx && s->magic == MAGIC_STREAM)
            return s;
    }
    for (int i = 0; i < PER_THREAD_SLOTS; i++) {
        struct sim_stream *s = &per_thread_stream[i];
        if (s->magic != MAGIC_STREAM || !sim_ctx_valid(s->ctx)) {
            *s = (struct sim_stream){.magic = MAGIC_STREAM, .ctx = ctx};
            return s;
        }
    }
    /* More contexts than slots on one thread: share the legacy stream,
     * which only costs concurrency the simulation does not have anyway. */
    return &ctx->legacy;
}

CUresult sim_resolve_stream(CUstream h, bool per_thread, struct sim_stream **out)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct sim_ctx *ctx;
        rc = sim_require_ctx(&ctx);
        if (rc)
            return rc;
        bool pts = h == CU_STREAM_PER_THREAD || (h == NULL && per_thread);
        *out = pts ? per_thread_of(ctx) : &ctx->legacy;
        return CUDA_SUCCESS;
    }
    struct sim_stream *s = (struct sim_stream *)h;
    if (s->magic != MAGIC_STREAM || !sim_ctx_valid(s->ctx))
        return CUDA_ERROR_INVALID_HANDLE;
    *out = s;
    return CUDA_SUCCESS;
}

CUresult sim_resolve_stream_args(CUstream h, bool per_thread, struct sim_stream **out, bool bad_args)
{
    CUresult rc = sim_resolve_stream(h, per_thread, out);
    return rc ? rc : bad_args ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

void sim_stream_run(struct sim_stream *s, uint64_t dur_ns)
{
    uint64_t end = sim_exec_reserve(&sim_drv.shared, s->ctx->dev, atomic_load(&s->tail), dur_ns);
    atomic_store(&s->tail, end);
    sim_ctx_note_end(s->ctx, end);
}

CUresult sim_stream_create(CUstream *phStream, unsigned int flags, int priority)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING));
    if (rc)
        return rc;
    struct sim_stream *s = malloc(sizeof(*s));
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Out-of-range priorities are clamped, as the driver does. */
    priority = priority > SIM_STREAM_PRIORITY_LEAST      ? SIM_STREAM_PRIORITY_LEAST
               : priority < SIM_STREAM_PRIORITY_GREATEST ? SIM_STREAM_PRIORITY_GREATEST
                                                         : priority;
    *s = (struct sim_stream){.magic = MAGIC_STREAM, .ctx = ctx, .flags = flags, .priority = priority};
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

CUresult sim_stream_get(CUstream h, bool per_thread, int *priority, unsigned *flags)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream(h, per_thread, &s);
    if (rc)
        return rc;
    if (priority)
        *priority = s->priority;
    if (flags)
        *flags = s->flags;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!hStream || hStream == CU_STREAM_LEGACY || hStream == CU_STREAM_PER_THREAD)
        return CUDA_ERROR_INVALID_HANDLE;
    struct sim_stream *s = (struct sim_stream *)hStream;
    if (s->magic != MAGIC_STREAM || s == &s->ctx->legacy)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_capture_forget(s);
    s->magic = MAGIC_DEAD;
    free(s);
    return CUDA_SUCCESS;
}

CUresult sim_stream_sync(CUstream h, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream(h, per_thread, &s);
    if (rc)
        return rc;
    sim_sleep_until(atomic_load(&s->tail));
    return CUDA_SUCCESS;
}

CUresult sim_stream_query(CUstream h, bool per_thread)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream(h, per_thread, &s);
    if (rc)
        return rc;
    return atomic_load(&s->tail) > sim_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

/* ---- events -------------------------------------------------------------------- */

static struct sim_event *event_of(CUevent h)
{
    struct sim_event *e = (struct sim_event *)h;
    return e && e->magic == MAGIC_EVENT ? e : NULL;
}

SIM_HANDLE_GET(event_get, CUevent, struct sim_event, MAGIC_EVENT, CUDA_ERROR_INVALID_HANDLE)

/* The stream, then the event, of a call on both (event_get: on an event alone). */
static CUresult stream_event(CUstream h, bool per_thread, CUevent ev, struct sim_stream **s, struct sim_event **e)
{
    CUresult rc = sim_resolve_stream(h, per_thread, s);
    if (rc)
        return rc;
    *e = event_of(ev);
    return *e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_stream_wait_event(CUstream h, CUevent ev, unsigned int flags, bool per_thread)
{
    struct sim_stream *s;
    struct sim_event *e;
    CUresult rc = stream_event(h, per_thread, ev, &s, &e);
    if (rc)
        return rc;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t when = atomic_load(&e->when), tail = atomic_load(&s->tail);
    if (atomic_load(&e->recorded) && when > tail)
        atomic_store(&s->tail, when);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !phEvent || (Flags & ~0x7u));
    if (rc)
        return rc;
    struct sim_event *e = calloc(1, sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->flags = Flags;
    *phEvent = (CUevent)e;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent)
{
    struct sim_event *e;
    CUresult rc = event_get(hEvent, &e);
    if (rc)
        return rc;
    e->magic = MAGIC_DEAD;
    free(e);
    return CUDA_SUCCESS;
}

CUresult sim_event_record(CUevent ev, CUstream h, bool per_thread)
{
    struct sim_stream *s;
    struct sim_event *e;
    CUresult rc = stream_event(h, per_thread, ev, &s, &e);
    if (rc)
        return rc;
    /* The event completes when the stream's queued work does, or now if
     * the stream is idle: device time, as the GPU would stamp it. */
    uint64_t now = sim_now_ns(), tail = atomic_load(&s->tail);
    atomic_store(&e->when, tail > now ? tail : now);
    atomic_store(&e->recorded, true);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventQuery(CUevent hEvent)
{
    struct sim_event *e;
    CUresult rc = event_get(hEvent, &e);
    if (rc)
        return rc;
    return atomic_load(&e->when) > sim_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    struct sim_event *e;
    CUresult rc = event_get(hEvent, &e);
    if (rc)
        return rc;
    sim_sleep_until(atomic_load(&e->when));
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_event *a = event_of(hStart), *b = event_of(hEnd);
    if (!pMilliseconds)
        return CUDA_ERROR_INVALID_VALUE;
    if (!a || !b || !atomic_load(&a->recorded) || !atomic_load(&b->recorded) ||
        ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = sim_now_ns(), ta = atomic_load(&a->when), tb = atomic_load(&b->when);
    if (ta > now || tb > now)
        return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)(((double)tb - (double)ta) / 1e6);
    return CUDA_SUCCESS;
}

/* ---- launches -------------------------------------------------------------------- */

struct launch_shape {
    unsigned grid[3], block[3];
    bool cooperative;
};

/* library.c: a library's kernel stands for its function on the current
 * context's device. */
struct sim_function *sim_kernel_function(struct sim_function *fn);

static struct sim_function *function_of(CUfunction f)
{
    struct sim_function *fn = (struct sim_function *)f;
    return fn && fn->magic == MAGIC_FUNC ? sim_kernel_function(fn) : NULL;
}

/* The function a call on it alone names, once the driver is initialised. */
static CUresult function_get(CUfunction h, struct sim_function **fn)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    *fn = function_of(h);
    return *fn ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Device time of one launch: the first parameter of a timed kernel. */
static uint64_t kernel_ns(const struct sim_function *fn, void **params, void **extra)
{
    if (fn->timed) {
        if (params && params[0])
            return *(const uint64_t *)params[0];
        for (int i = 0; extra && extra[i] != CU_LAUNCH_PARAM_END && i < 16; i += 2) {
            if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER && extra[i + 1])
                return *(const uint64_t *)extra[i + 1];
        }
    }
    return sim_cfg()->default_kernel_ns;
}

static CUresult check_shape(const struct sim_function *fn, const struct launch_shape *sh, int dev)
{
    for (int i = 0; i < 3; i++) {
        if (sh->grid[i] == 0 || sh->block[i] == 0)
            return CUDA_ERROR_INVALID_VALUE;
    }
    if ((uint64_t)sh->block[0] * sh->block[1] * sh->block[2] > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (fn->module->dev != dev)
        return CUDA_ERROR_INVALID_HANDLE;
    if (sh->cooperative) {
        /* Every block of a cooperative grid must be resident at once. */
        uint64_t blocks = (uint64_t)sh->grid[0] * sh->grid[1] * sh->grid[2];
        if (blocks > (uint64_t)sim_cfg()->gpu[dev].sm_count * 32)
            return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    }
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, const struct launch_shape *sh, CUstream h, bool per_thread, void **params,
                       void **extra)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream(h, per_thread, &s);
    if (rc)
        return rc;
    struct sim_function *fn = function_of(f);
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = check_shape(fn, sh, s->ctx->dev)))
        return rc;
    bool captured;
    if ((rc = sim_capture_launch(s, (CUfunction)fn, sh->grid, sh->block, params, extra, &captured)) || captured)
        return rc;
    sim_stream_run(s, kernel_ns(fn, params, extra));
    return CUDA_SUCCESS;
}

#define SHAPE(coop)                                                                                            \
    (struct launch_shape)                                                                                      \
    {                                                                                                          \
        .grid = {gridDimX, gridDimY, gridDimZ}, .block = {blockDimX, blockDimY, blockDimZ}, .cooperative = coop \
    }

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                   unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    return launch(f, &SHAPE(false), hStream, false, kernelParams, extra);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    return launch(f, &SHAPE(false), hStream, true, kernelParams, extra);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                              unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                              unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                              void **kernelParams)
{
    (void)sharedMemBytes;
    return launch(f, &SHAPE(true), hStream, false, kernelParams, NULL);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                   unsigned int gridDimZ, unsigned int blockDimX,
                                                   unsigned int blockDimY, unsigned int blockDimZ,
                                                   unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    (void)sharedMemBytes;
    return launch(f, &SHAPE(true), hStream, true, kernelParams, NULL);
}

#define MULTI_DEVICE_FLAGS \
    (CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_PRE_LAUNCH_SYNC | CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_POST_LAUNCH_SYNC)

/* One cooperative grid per device, each on its own (created) stream. Unless
 * told otherwise, every kernel waits for the work queued before it in all
 * the streams, and later work in any of them waits for every kernel. */
SIM_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                                         unsigned int numDevices, unsigned int flags)
{
    CUresult rc = sim_check_init_args(!launchParamsList || numDevices == 0 || numDevices > SIM_MAX_GPUS ||
                                      (flags & ~(unsigned)MULTI_DEVICE_FLAGS));
    if (rc)
        return rc;
    struct sim_stream *s[SIM_MAX_GPUS];
    uint64_t ns[SIM_MAX_GPUS], start = 0;
    for (unsigned i = 0; i < numDevices; i++) {
        const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
        if (p->hStream == NULL || p->hStream == CU_STREAM_LEGACY || p->hStream == CU_STREAM_PER_THREAD)
            return CUDA_ERROR_INVALID_VALUE;
        if ((rc = sim_resolve_stream(p->hStream, false, &s[i])))
            return rc;
        for (unsigned k = 0; k < i; k++)
            if (s[k]->ctx->dev == s[i]->ctx->dev)
                return CUDA_ERROR_INVALID_VALUE; /* one grid per device */
        struct sim_function *fn = function_of(p->function);
        if (!fn)
            return CUDA_ERROR_INVALID_HANDLE;
        struct launch_shape sh = {.grid = {p->gridDimX, p->gridDimY, p->gridDimZ},
                                  .block = {p->blockDimX, p->blockDimY, p->blockDimZ},
                                  .cooperative = true};
        if ((rc = check_shape(fn, &sh, s[i]->ctx->dev)))
            return rc;
        ns[i] = kernel_ns(fn, p->kernelParams, NULL);
        uint64_t tail = atomic_load(&s[i]->tail);
        start = tail > start ? tail : start;
    }
    uint64_t end = 0;
    for (unsigned i = 0; i < numDevices; i++) {
        if (!(flags & CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_PRE_LAUNCH_SYNC) && atomic_load(&s[i]->tail) < start)
            atomic_store(&s[i]->tail, start);
        sim_stream_run(s[i], ns[i]);
        uint64_t tail = atomic_load(&s[i]->tail);
        end = tail > end ? tail : end;
    }
    for (unsigned i = 0; i < numDevices && !(flags & CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_POST_LAUNCH_SYNC); i++)
        if (atomic_load(&s[i]->tail) < end) {
            atomic_store(&s[i]->tail, end);
            sim_ctx_note_end(s[i]->ctx, end);
        }
    return CUDA_SUCCESS;
}

CUresult sim_launch_ex(const CUlaunchConfig *c, CUfunction f, void **params, void **extra, bool per_thread)
{
    if (!c || (c->numAttrs && !c->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    struct launch_shape sh = {.grid = {c->gridDimX, c->gridDimY, c->gridDimZ},
                              .block = {c->blockDimX, c->blockDimY, c->blockDimZ}};
    for (unsigned i = 0; i < c->numAttrs; i++) {
        if (c->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE)
            sh.cooperative = c->attrs[i].value.cooperative != 0;
    }
    return launch(f, &sh, c->hStream, per_thread, params, extra);
}

/* ---- the deprecated execution-control API ---------------------------------------- */

SIM_EXPORT CUresult cuFuncSetBlockShape(CUfunction hfunc, int x, int y, int z)
{
    struct sim_function *fn;
    CUresult rc = function_get(hfunc, &fn);
    if (rc)
        return rc;
    if (x <= 0 || y <= 0 || z <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    fn->legacy.block[0] = (unsigned)x;
    fn->legacy.block[1] = (unsigned)y;
    fn->legacy.block[2] = (unsigned)z;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuFuncSetSharedSize(CUfunction hfunc, unsigned int bytes)
{
    struct sim_function *fn;
    CUresult rc = function_get(hfunc, &fn);
    if (rc)
        return rc;
    fn->legacy.shared_bytes = bytes;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuParamSetSize(CUfunction hfunc, unsigned int numbytes)
{
    struct sim_function *fn;
    CUresult rc = function_get(hfunc, &fn);
    if (rc)
        return rc;
    if (numbytes > SIM_LEGACY_PARAM_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    fn->legacy.param_size = numbytes;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuParamSetv(CUfunction hfunc, int offset, void *ptr, unsigned int numbytes)
{
    struct sim_function *fn;
    CUresult rc = function_get(hfunc, &fn);
    if (rc)
        return rc;
    if (offset < 0 || !ptr || numbytes > SIM_LEGACY_PARAM_MAX ||
        (unsigned)offset > SIM_LEGACY_PARAM_MAX - numbytes)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(fn->legacy.params + offset, ptr, numbytes);
    return CUDA_SUCCESS;
}

/* A grid_width x grid_height grid of the shape cuFuncSetBlockShape gave,
 * with the parameter buffer cuParamSet* filled, on the NULL stream. */
CUresult sim_launch_legacy(CUfunction f, int grid_width, int grid_height, CUstream h)
{
    struct sim_function *fn;
    CUresult rc = function_get(f, &fn);
    if (rc)
        return rc;
    if (grid_width <= 0 || grid_height <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (fn->timed && fn->legacy.param_size < sizeof(uint64_t))
        return CUDA_ERROR_INVALID_VALUE; /* its u64 parameter was never set */
    struct launch_shape sh = {.grid = {(unsigned)grid_width, (unsigned)grid_height, 1},
                              .block = {fn->legacy.block[0], fn->legacy.block[1], fn->legacy.block[2]}};
    size_t size = fn->legacy.param_size;
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, fn->legacy.params, CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                     CU_LAUNCH_PARAM_END};
    return launch(f, &sh, h, false, NULL, extra);
}

/* ---- graphs ---------------------------------------------------------------------- */

struct sim_graph {
    uint32_t magic;
    int dev;
    size_t nodes, cap;
    uint64_t *node_ns;            /* device time of each kernel node */
    uint64_t alloc_bytes;         /* of its memory-allocation nodes */
};

/* The memory of a graph's allocation nodes is held from instantiation to
 * destruction of the executable graph (a real driver allocates it at the
 * first launch and keeps it in the graph pool until trimmed). */
struct sim_graph_exec {
    uint32_t magic;
    int dev;
    uint64_t total_ns;
    uint64_t alloc_bytes;
};

SIM_HANDLE_GET(graph_get, CUgraph, struct sim_graph, MAGIC_GRAPH, CUDA_ERROR_INVALID_VALUE)
SIM_HANDLE_GET(exec_get, CUgraphExec, struct sim_graph_exec, MAGIC_GRAPH_EXEC, CUDA_ERROR_INVALID_VALUE)

SIM_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !phGraph || flags != 0);
    if (rc)
        return rc;
    struct sim_graph *g = calloc(1, sizeof(*g));
    if (!g)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = MAGIC_GRAPH;
    g->dev = ctx->dev;
    *phGraph = (CUgraph)g;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    struct sim_graph *g;
    CUresult rc = graph_get(hGraph, &g);
    if (rc)
        return rc;
    g->magic = MAGIC_DEAD;
    free(g->node_ns);
    free(g);
    return CUDA_SUCCESS;
}

/* Kernel parameters are captured when the node is added, as the driver does. */
static CUresult add_kernel_node(CUgraphNode *phNode, CUgraph hGraph, size_t numDependencies, const void *deps,
                                CUfunction func, const struct launch_shape *sh, void **params, void **extra)
{
    struct sim_graph *g;
    CUresult rc = graph_get(hGraph, &g);
    if (rc)
        return rc;
    struct sim_function *fn = function_of(func);
    if (!phNode || (numDependencies && !deps))
        return CUDA_ERROR_INVALID_VALUE;
    if (!fn)
        return CUDA_ERROR_INVALID_HANDLE;
    if ((rc = check_shape(fn, sh, g->dev)))
        return rc;
    if (g->nodes == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 8;
        uint64_t *grown = realloc(g->node_ns, cap * sizeof(*grown));
        if (!grown)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g->node_ns = grown;
        g->cap = cap;
    }
    g->node_ns[g->nodes] = kernel_ns(fn, params, extra);
    /* A node handle encodes graph and index without another allocation. */
    *phNode = (CUgraphNode)(uintptr_t)(g->nodes + 1);
    g->nodes++;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                         size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    struct launch_shape sh = {.grid = {p->gridDimX, p->gridDimY, p->gridDimZ},
                              .block = {p->blockDimX, p->blockDimY, p->blockDimZ}};
    return add_kernel_node(phGraphNode, hGraph, numDependencies, dependencies, p->func, &sh, p->kernelParams,
                           p->extra);
}

SIM_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                            const CUgraphNode *dependencies, size_t numDependencies,
                                            const CUDA_KERNEL_NODE_PARAMS *p)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    struct launch_shape sh = {.grid = {p->gridDimX, p->gridDimY, p->gridDimZ},
                              .block = {p->blockDimX, p->blockDimY, p->blockDimZ}};
    /* With no func, the node runs kern (libcudart 13.5 adds nodes so); the
     * simulation resolves it in the calling thread's context, the one the
     * runtime names in ctx. */
    CUfunction func = p->func ? p->func : (CUfunction)p->kern;
    return add_kernel_node(phGraphNode, hGraph, numDependencies, dependencies, func, &sh, p->kernelParams,
                           p->extra);
}

/* Only memory-allocation nodes are simulated through the generic call. */
CUresult sim_graph_add_node(CUgraphNode *phNode, CUgraph hGraph, size_t numDependencies, const void *deps,
                            CUgraphNodeParams *p)
{
    struct sim_graph *g;
    CUresult rc = graph_get(hGraph, &g);
    if (rc)
        return rc;
    if (!phNode || !p || (numDependencies && !deps))
        return CUDA_ERROR_INVALID_VALUE;
    if (p->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return CUDA_ERROR_NOT_SUPPORTED;
    uint64_t size = p->alloc.bytesize;
    if (size == 0 || p->alloc.poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        size > UINT64_MAX - g->alloc_bytes)
        return CUDA_ERROR_INVALID_VALUE;
    p->alloc.dptr = sim_graph_va(g->dev, size);
    g->alloc_bytes += size;
    *phNode = (CUgraphNode)(uintptr_t)(g->nodes + 1 + (1ULL << 32)); /* never a kernel node's index */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                      const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                      CUgraphNodeParams *nodeParams)
{
    (void)dependencyData;
    return sim_graph_add_node(phGraphNode, hGraph, numDependencies, dependencies, nodeParams);
}

SIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    struct sim_graph *g;
    CUresult rc = graph_get(hGraph, &g);
    if (rc)
        return rc;
    if (!phGraphExec || (flags & ~0xfULL))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_graph_exec *x = malloc(sizeof(*x));
    if (!x)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *x = (struct sim_graph_exec){.magic = MAGIC_GRAPH_EXEC, .dev = g->dev, .alloc_bytes = g->alloc_bytes};
    if (x->alloc_bytes && !sim_mem_charge(&sim_drv.shared, g->dev, x->alloc_bytes)) {
        free(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < g->nodes; i++)
        x->total_ns += g->node_ns[i];
    *phGraphExec = (CUgraphExec)x;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    struct sim_graph_exec *x;
    CUresult rc = exec_get(hGraphExec, &x);
    if (rc)
        return rc;
    if (x->alloc_bytes)
        sim_mem_release(&sim_drv.shared, x->dev, x->alloc_bytes);
    x->magic = MAGIC_DEAD;
    free(x);
    return CUDA_SUCCESS;
}

CUresult sim_graph_launch(CUgraphExec hGraphExec, CUstream h, bool per_thread)
{
    struct sim_stream *s;
    struct sim_graph_exec *x;
    CUresult rc = sim_resolve_stream(h, per_thread, &s);
    if (rc || (rc = exec_get(hGraphExec, &x)))
        return rc;
    if (x->dev != s->ctx->dev)
        return CUDA_ERROR_INVALID_CONTEXT;
    /* The nodes run back to back on one device: one stretch of device time. */
    if (x->total_ns)
        sim_stream_run(s, x->total_ns);
    return CUDA_SUCCESS;
}

/* ---- function attributes -------------------------------------------------------------- */

#define SHARED_PER_BLOCK 49152          /* CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK */
#define SHARED_PER_BLOCK_OPTIN 232448   /* ..._OPTIN: what a kernel may opt into */

/* What a small kernel compiled for the GPU reports: no static shared,
 * constant or local memory, 16 registers, code for the GPU's own
 * compute capability (the simulation JIT-compiles PTX for it). */
static int function_default(const struct sim_function *fn, CUfunction_attribute a)
{
    const struct sim_gpu_config *g = &sim_cfg()->gpu[fn->module->dev];
    switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: return 16;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: return (int)(g->cc_major * 10 + g->cc_minor);
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: return SHARED_PER_BLOCK;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: return -1;
    default: return 0;
    }
}

SIM_EXPORT CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    struct sim_function *fn;
    CUresult rc = function_get(hfunc, &fn);
    if (rc)
        return rc;
    if (!pi || (unsigned)attrib >= CU_FUNC_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    *pi = (fn->attr_set >> attrib) & 1u ? fn->attr[attrib] : function_default(fn, attrib);
    return CUDA_SUCCESS;
}

/* Only the attributes the driver lets a program set, within their ranges. */
SIM_EXPORT CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value)
{
    struct sim_function *fn;
    CUresult rc = function_get(hfunc, &fn);
    if (rc)
        return rc;
    bool ok;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: ok = value >= 0 && value <= SHARED_PER_BLOCK_OPTIN; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: ok = value >= -1 && value <= 100; break;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH: ok = value >= 0 && value <= 16; break;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: ok = value == 0 || value == 1; break;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE: ok = value >= 0 && value <= 2; break;
    default: ok = false;
    }
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    fn->attr[attrib] = value;
    fn->attr_set |= 1u << attrib;
    return CUDA_SUCCESS;
}

/* A preference only, as the context's (cuCtxSetCacheConfig). */
SIM_EXPORT CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config)
{
    struct sim_function *fn;
    CUresult rc = function_get(hfunc, &fn);
    if (rc)
        return rc;
    return (unsigned)config <= CU_FUNC_CACHE_PREFER_EQUAL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_stream_ctx(CUstream h, bool per_thread, CUcontext *pctx)
{
    struct sim_stream *s;
    CUresult rc = sim_resolve_stream(h, per_thread, &s);
    if (rc)
        return rc;
    *pctx = (CUcontext)s->ctx;
    return CUDA_SUCCESS;
}
