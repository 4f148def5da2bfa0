/* Simulated libcuda.so.1: CUDA arrays. They are charged to their GPU and
 * hold no bytes. */
#define _GNU_SOURCE
#include <stdlib.h>

#include "cgpu/array_format.h"
#include "driver.h"

struct sim_array {
    uint32_t magic;
    int dev;
    uint64_t size;
};

/* Bytes of a W x H x D array level, 0 if the description is invalid. */
static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels)
{
    uint64_t elem = cgpu_array_format_bytes(f);
    if (!elem || w == 0 || (channels != 1 && channels != 2 && channels != 4))
        return 0;
    uint64_t n = (uint64_t)w * (h ? h : 1);
    if (d && n > UINT64_MAX / d)
        return 0;
    n *= d ? d : 1;
    return n > UINT64_MAX / (elem * channels) ? 0 : n * elem * channels;
}

static CUresult create_array(void **out, uint64_t bytes)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !out || bytes == 0);
    if (rc)
        return rc;
    struct sim_array *a = malloc(sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!sim_mem_charge(&sim_drv.shared, ctx->dev, bytes)) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *a = (struct sim_array){.magic = MAGIC_ARRAY, .dev = ctx->dev, .size = bytes};
    *out = a;
    return CUDA_SUCCESS;
}

CUresult sim_array_destroy(void *handle)
{
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    struct sim_array *a = handle;
    if (!a || a->magic != MAGIC_ARRAY)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_mem_release(&sim_drv.shared, a->dev, a->size);
    a->magic = MAGIC_DEAD;
    free(a);
    return CUDA_SUCCESS;
}

/* maxTexture2D / maxTexture3D of a compute capability 9.0 GPU. */
#define MAX_2D_WIDTH 131072
#define MAX_2D_HEIGHT 65536
#define MAX_3D_EXTENT 16384

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (!pHandle || !d || d->Width > MAX_2D_WIDTH || d->Height > MAX_2D_HEIGHT)
        return CUDA_ERROR_INVALID_VALUE;
    return create_array((void **)pHandle, array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels));
}

static bool extent3d_ok(const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (d->Depth == 0)
        return d->Width <= MAX_2D_WIDTH && d->Height <= MAX_2D_HEIGHT;
    return d->Width <= MAX_3D_EXTENT && d->Height <= MAX_3D_EXTENT && d->Depth <= MAX_3D_EXTENT;
}

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (!pHandle || !d || !extent3d_ok(d))
        return CUDA_ERROR_INVALID_VALUE;
    return create_array((void **)pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels));
}

SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                           unsigned int numMipmapLevels)
{
    if (!pHandle || !d || numMipmapLevels == 0 || numMipmapLevels > 32 || !extent3d_ok(d))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t total = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned l = 0; l < numMipmapLevels; l++) {
        uint64_t level = array_bytes(w, h, z, d->Format, d->NumChannels);
        if (!level || total > UINT64_MAX - level)
            return CUDA_ERROR_INVALID_VALUE;
        total += level;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        z = z > 1 ? z / 2 : z;
    }
    return create_array((void **)pHandle, total);
}

SIM_EXPORT CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY_DESCRIPTOR wide = {d->Width, d->Height, d->Format, d->NumChannels};
    return cuArrayCreate_v2(pHandle, &wide);
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR wide = {d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags};
    return cuArray3DCreate_v2(pHandle, &wide);
}
