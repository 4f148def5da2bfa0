/* Simulated libcuda.so.1: the context limits that hold device memory
 * (stack, printf FIFO, malloc heap). */
#define _GNU_SOURCE
#include <string.h>

#include "driver.h"

#define DEFAULT_STACK 1024ULL
#define DEFAULT_FIFO (1ULL << 20)
#define DEFAULT_HEAP (8ULL << 20)
#define THREADS_PER_SM 2048ULL /* CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR */

static uint64_t limit_value(const struct sim_ctx *ctx, CUlimit l)
{
    static const uint64_t dflt[3] = {DEFAULT_STACK, DEFAULT_FIFO, DEFAULT_HEAP};
    return ctx->limit[l] ? ctx->limit[l] : dflt[l];
}

/* Device bytes the settings hold beyond the defaults: the stack for every
 * thread the GPU can hold resident, the heap and the FIFO. UINT64_MAX when
 * that cannot be counted. */
static uint64_t limits_extra(const struct sim_ctx *ctx, const uint64_t v[3])
{
    uint64_t threads = THREADS_PER_SM * sim_cfg()->gpu[ctx->dev].sm_count;
    uint64_t stack = v[CU_LIMIT_STACK_SIZE] > DEFAULT_STACK ? v[CU_LIMIT_STACK_SIZE] - DEFAULT_STACK : 0;
    uint64_t fifo = v[CU_LIMIT_PRINTF_FIFO_SIZE] > DEFAULT_FIFO ? v[CU_LIMIT_PRINTF_FIFO_SIZE] - DEFAULT_FIFO : 0;
    uint64_t heap = v[CU_LIMIT_MALLOC_HEAP_SIZE] > DEFAULT_HEAP ? v[CU_LIMIT_MALLOC_HEAP_SIZE] - DEFAULT_HEAP : 0;
    if (threads && stack > UINT64_MAX / threads)
        return UINT64_MAX;
    stack *= threads;
    return stack > UINT64_MAX - fifo - heap || fifo > UINT64_MAX - heap ? UINT64_MAX : stack + fifo + heap;
}

void sim_ctx_drop_limits(struct sim_ctx *ctx)
{
    if (ctx->limit_charged)
        sim_mem_release(&sim_drv.shared, ctx->dev, ctx->limit_charged);
    ctx->limit_charged = 0;
    memset(ctx->limit, 0, sizeof(ctx->limit));
}

SIM_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    if (rc)
        return rc;
    if ((unsigned)limit > CU_LIMIT_MALLOC_HEAP_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    pthread_mutex_lock(&sim_drv.lock);
    uint64_t v[3];
    for (int i = 0; i < 3; i++)
        v[i] = limit_value(ctx, (CUlimit)i);
    v[limit] = value ? value : 1;
    uint64_t want = limits_extra(ctx, v), have = ctx->limit_charged;
    if (want == UINT64_MAX || (want > have && !sim_mem_charge(&sim_drv.shared, ctx->dev, want - have))) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        if (want < have)
            sim_mem_release(&sim_drv.shared, ctx->dev, have - want);
        ctx->limit[limit] = v[limit];
        ctx->limit_charged = want;
    }
    pthread_mutex_unlock(&sim_drv.lock);
    return rc;
}

SIM_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx_args(&ctx, !pvalue);
    if (rc)
        return rc;
    if ((unsigned)limit > CU_LIMIT_MALLOC_HEAP_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    pthread_mutex_lock(&sim_drv.lock);
    *pvalue = (size_t)limit_value(ctx, limit);
    pthread_mutex_unlock(&sim_drv.lock);
    return CUDA_SUCCESS;
}
