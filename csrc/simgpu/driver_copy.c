/* Simulated libcuda.so.1: copies and fills of device memory. */
#define _GNU_SOURCE
#include <string.h>

#include "driver.h"

/* Where n bytes at a unified address live in this process: device memory's
 * backing (mapped on first touch) or, for an address no device allocation
 * holds, the host memory at that address, as unified addressing lets a copy
 * take pageable host memory. A range running past its allocation, or device
 * addresses the driver handed out and no allocation holds any more, are
 * invalid. Caller holds sim_drv.lock. */
static CUresult bytes_at(CUdeviceptr p, size_t n, void **out)
{
    if (p == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct alloc_entry *hit = sim_entry_at(p);
    if (!hit) {
        for (int d = 0; d < SIM_MAX_GPUS; d++) {
            if (p >= SIM_VA_BASE(d) && p < sim_drv.next_va[d])
                return CUDA_ERROR_INVALID_VALUE; /* freed, reserved or a graph's: no bytes here */
        }
        *out = (void *)(uintptr_t)p;
        return CUDA_SUCCESS;
    }
    if (n > hit->size - (p - hit->ptr))
        return CUDA_ERROR_INVALID_VALUE;
    void **backing = hit->kind == ALLOC_MAPPED ? &hit->handle->bytes : &hit->bytes;
    uint64_t size = hit->kind == ALLOC_MAPPED ? hit->handle->size : hit->size;
    if (!*backing && !(*backing = sim_backing_map(size)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = (char *)*backing + (p - hit->ptr);
    return CUDA_SUCCESS;
}

/* The stream a copy is ordered on; `sync`: the call returns once the work
 * queued before it is done, as a synchronous copy does (on the legacy
 * stream that is all of the context's blocking work). */
CUresult sim_copy_stream(CUstream h, bool per_thread, bool sync, struct sim_stream **out)
{
    CUresult rc = sim_resolve_stream(h, per_thread, out);
    if (rc)
        return rc;
    if (sync) {
        struct sim_stream *s = *out;
        sim_sleep_until(s == &s->ctx->legacy ? atomic_load(&s->ctx->last_end) : atomic_load(&s->tail));
    }
    return CUDA_SUCCESS;
}

/* The bytes move when the call is made, asynchronous or not: simulated
 * kernels never read or write memory, so nothing queued before the copy can
 * change what it moves, and the copy itself takes no simulated time. The
 * lock is held across the move so that a concurrent free cannot unmap the
 * backing under it. */
CUresult sim_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h, bool per_thread, bool sync)
{
    struct sim_stream *s;
    CUresult rc = sim_copy_stream(h, per_thread, sync, &s);
    if (rc || n == 0)
        return rc;
    void *d, *from;
    pthread_mutex_lock(&sim_drv.lock);
    rc = bytes_at(dst, n, &d);
    if (!rc)
        rc = bytes_at(src, n, &from);
    if (!rc)
        memmove(d, from, n);
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

/* Bytes from the first row's start to the last row's end, or 0 when that
 * overflows. */
static size_t span_2d(size_t pitch, size_t width, size_t height)
{
    size_t rows, span;
    if (__builtin_mul_overflow(height - 1, pitch, &rows) || __builtin_add_overflow(rows, width, &span))
        return 0;
    return span;
}

/* `height` rows of `width` elements of `elem` bytes, rows `pitch` bytes
 * apart, set to `value`. */
CUresult sim_fill_2d(CUdeviceptr dst, size_t pitch, unsigned value, size_t elem, size_t width, size_t height,
                     CUstream h, bool per_thread, bool sync)
{
    struct sim_stream *s;
    CUresult rc = sim_copy_stream(h, per_thread, sync, &s);
    if (rc || width == 0 || height == 0)
        return rc;
    size_t row;
    if (dst % elem || __builtin_mul_overflow(width, elem, &row) || (height > 1 && (pitch < row || pitch % elem)))
        return CUDA_ERROR_INVALID_VALUE;
    size_t span = height > 1 ? span_2d(pitch, row, height) : row;
    if (!span)
        return CUDA_ERROR_INVALID_VALUE;
    char *d;
    pthread_mutex_lock(&sim_drv.lock);
    rc = bytes_at(dst, span, (void **)&d);
    for (size_t y = 0; !rc && y < height; y++) {
        char *line = d + y * pitch;
        if (elem == 1) {
            memset(line, (int)value, width);
        } else {
            uint32_t v = value;
            for (size_t i = 0; i < width; i++)
                memcpy(line + i * elem, &v, elem); /* little-endian: the low bytes */
        }
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

CUresult sim_fill(CUdeviceptr dst, unsigned value, size_t elem, size_t count, CUstream h, bool per_thread,
                  bool sync)
{
    return sim_fill_2d(dst, 0, value, elem, count, 1, h, per_thread, sync);
}

/* One side of a 2D copy as a unified address. Arrays hold no bytes in the
 * simulation (they are only charged), so copies to or from them are not
 * supported. */
static CUresult copy_side(CUmemorytype type, const void *host, CUdeviceptr dev, CUdeviceptr *out)
{
    switch (type) {
    case CU_MEMORYTYPE_HOST: *out = SIM_HOST_ADDR(host); return CUDA_SUCCESS;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED: *out = dev; return CUDA_SUCCESS;
    case CU_MEMORYTYPE_ARRAY: return CUDA_ERROR_NOT_SUPPORTED;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult sim_copy_2d(const CUDA_MEMCPY2D *c, CUstream h, bool per_thread, bool sync)
{
    struct sim_stream *s;
    CUresult rc = sim_copy_stream(h, per_thread, sync, &s);
    if (rc)
        return rc;
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr src, dst;
    if ((rc = copy_side(c->srcMemoryType, c->srcHost, c->srcDevice, &src)) ||
        (rc = copy_side(c->dstMemoryType, c->dstHost, c->dstDevice, &dst)))
        return rc;
    size_t w = c->WidthInBytes, rows = c->Height;
    if (w == 0 || rows == 0)
        return CUDA_SUCCESS;
    size_t sp = rows > 1 ? c->srcPitch : w, dp = rows > 1 ? c->dstPitch : w;
    size_t src_off, dst_off;
    if (sp < w || dp < w || __builtin_mul_overflow(c->srcY, sp, &src_off) ||
        __builtin_add_overflow(src_off, c->srcXInBytes, &src_off) || __builtin_mul_overflow(c->dstY, dp, &dst_off) ||
        __builtin_add_overflow(dst_off, c->dstXInBytes, &dst_off))
        return CUDA_ERROR_INVALID_VALUE;
    size_t src_span = span_2d(sp, w, rows), dst_span = span_2d(dp, w, rows);
    if (!src_span || !dst_span)
        return CUDA_ERROR_INVALID_VALUE;
    char *d, *f;
    pthread_mutex_lock(&sim_drv.lock);
    rc = bytes_at(dst + dst_off, dst_span, (void **)&d);
    if (!rc)
        rc = bytes_at(src + src_off, src_span, (void **)&f);
    for (size_t y = 0; !rc && y < rows; y++)
        memmove(d + y * dp, f + y * sp, w);
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

/* Unified addressing names every byte of every GPU: a peer copy is a copy
 * once both contexts are known good. */
CUresult sim_copy_peer(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx, size_t n,
                       CUstream h, bool per_thread, bool sync)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_ctx_valid((struct sim_ctx *)dst_ctx) || !sim_ctx_valid((struct sim_ctx *)src_ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return sim_copy(dst, src, n, h, per_thread, sync);
}
