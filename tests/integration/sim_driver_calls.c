/* Ordinary driver calls a framework makes, built against NVIDIA's cuda.h
 * (the real header's macros pick the exported names: cuMemAllocHost ->
 * cuMemAllocHost_v2, ...) and linked against the simulated libcuda.so.1.
 * Prints one JSON object of what each call answered. argv[1]: bytes of
 * pinned memory to take (more than the GPU holds, to show it is host
 * memory). */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N (1 << 20)

static int ok_count, first_fail_line;
#define CHECK(call)                                                    \
    do {                                                               \
        CUresult rc_ = (call);                                         \
        if (rc_ == CUDA_SUCCESS)                                       \
            ok_count++;                                                \
        else if (!first_fail_line) {                                   \
            first_fail_line = __LINE__;                                \
            fprintf(stderr, "line %d: %s -> %d\n", __LINE__, #call, rc_); \
        }                                                              \
    } while (0)

int main(int argc, char **argv)
{
    size_t big = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30;
    CUcontext ctx;
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));

    size_t free0, total, free1, free2;
    CHECK(cuMemGetInfo(&free0, &total));

    /* Pinned memory larger than the GPU: host memory, never charged. */
    void *huge = NULL;
    CUresult huge_rc = cuMemAllocHost(&huge, big);
    CHECK(cuMemGetInfo(&free1, &total));
    if (huge)
        ((volatile char *)huge)[big - 1] = 1;

    /* A round trip: pinned -> device -> registered pageable -> device -> pinned. */
    unsigned char *src, *back;
    CHECK(cuMemHostAlloc((void **)&src, N, CU_MEMHOSTALLOC_DEVICEMAP));
    CHECK(cuMemAllocHost((void **)&back, N));
    unsigned char *pageable = malloc(N);
    CHECK(cuMemHostRegister(pageable, N, CU_MEMHOSTREGISTER_PORTABLE));
    for (int i = 0; i < N; i++)
        src[i] = (unsigned char)(i * 7 + 3);
    CUdeviceptr d1, d2;
    CHECK(cuMemAlloc(&d1, N));
    CHECK(cuMemAlloc(&d2, N));
    CHECK(cuMemGetInfo(&free2, &total));
    CHECK(cuMemcpyHtoD(d1, src, N));
    CHECK(cuMemcpyDtoH(pageable, d1, N));
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemcpyAsync(d2, (CUdeviceptr)(uintptr_t)pageable, N, s)); /* unified addressing */
    CHECK(cuStreamSynchronize(s));
    CHECK(cuMemsetD8(d2 + 16, 0xAB, 4));
    CHECK(cuMemcpy((CUdeviceptr)(uintptr_t)back, d2, N));
    int roundtrip = memcmp(src + 20, back + 20, N - 20) == 0 && memcmp(src, back, 16) == 0 &&
                    back[16] == 0xAB && back[19] == 0xAB;
    CUresult past_end = cuMemcpyDtoH(back, d1 + 1, N);

    /* What the driver says of each address, and a pool's usage. */
    unsigned type_dev = 0, type_pinned = 0, type_pageable = 9;
    CHECK(cuPointerGetAttribute(&type_dev, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d1 + 5));
    CHECK(cuPointerGetAttribute(&type_pinned, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)src));
    CUpointer_attribute which[1] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE};
    void *data[1] = {&type_pageable};
    unsigned char on_stack[16];
    CHECK(cuPointerGetAttributes(1, which, data, (CUdeviceptr)(uintptr_t)on_stack));
    CUmemoryPool pool;
    CUdeviceptr from_pool;
    cuuint64_t pool_used = 0;
    CHECK(cuDeviceGetMemPool(&pool, dev));
    CHECK(cuMemAllocAsync(&from_pool, 4096, s));
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &pool_used));
    CHECK(cuMemFreeAsync(from_pool, s));

    /* 2D: a 4x3 block of a 16-byte-wide host matrix into a pitched buffer,
     * a 2D fill below it, all of it back; D16 fills; a copy to the other GPU. */
    unsigned char mat[8][16], out[8][16];
    memset(out, 0xEE, sizeof(out));
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 16; c++)
            mat[r][c] = (unsigned char)(r * 16 + c);
    CUdeviceptr pitched;
    size_t pitch = 0;
    CHECK(cuMemAllocPitch(&pitched, &pitch, 16, 8, 4));
    CHECK(cuMemsetD8(pitched, 0, pitch * 8));
    CUDA_MEMCPY2D up = {.srcXInBytes = 2, .srcY = 1, .srcMemoryType = CU_MEMORYTYPE_HOST, .srcHost = mat,
                        .srcPitch = 16, .dstMemoryType = CU_MEMORYTYPE_DEVICE, .dstDevice = pitched,
                        .dstPitch = pitch, .WidthInBytes = 4, .Height = 3};
    CHECK(cuMemcpy2D(&up));
    CHECK(cuMemsetD2D32(pitched + pitch * 5, pitch, 0x01020304u, 2, 2));
    CUDA_MEMCPY2D down = {.srcMemoryType = CU_MEMORYTYPE_DEVICE, .srcDevice = pitched, .srcPitch = pitch,
                          .dstMemoryType = CU_MEMORYTYPE_HOST, .dstHost = out, .dstPitch = 16,
                          .WidthInBytes = 16, .Height = 8};
    CHECK(cuMemcpy2DAsync(&down, s));
    CHECK(cuStreamSynchronize(s));
    int block_ok = 1;
    for (int r = 0; r < 3; r++)
        block_ok &= memcmp(out[r], &mat[r + 1][2], 4) == 0 && out[r][4] == 0;
    block_ok &= out[3][0] == 0 && out[5][0] == 4 && out[5][3] == 1 && out[6][7] == 1 && out[6][8] == 0;
    CUDA_MEMCPY2D to_array = up;
    to_array.dstMemoryType = CU_MEMORYTYPE_ARRAY;
    CUresult array_rc = cuMemcpy2D(&to_array);
    unsigned short halves[4] = {0};
    CHECK(cuMemsetD16(d1, 0xBEEF, 4));
    CHECK(cuMemcpyDtoH(halves, d1, sizeof(halves)));
    int d16_ok = halves[0] == 0xBEEF && halves[3] == 0xBEEF;
    CUcontext ctx1;
    CUdeviceptr on1;
    unsigned char peer_back[64] = {0};
    CHECK(cuDevicePrimaryCtxRetain(&ctx1, 1));
    CHECK(cuCtxPushCurrent(ctx1));
    CHECK(cuMemAlloc(&on1, 64));
    CHECK(cuCtxPopCurrent(NULL));
    CHECK(cuMemcpyPeer(on1, ctx1, d1 + 64, ctx, 64));
    CHECK(cuMemcpyDtoH(peer_back, on1, 64));
    int peer_ok = memcmp(peer_back, src + 64, 64) == 0;
    /* Its own IPC handle opens too (through /proc/self): the same bytes. */
    CUipcMemHandle ipc;
    CUdeviceptr opened = 0;
    unsigned char ipc_back[64] = {0};
    CHECK(cuIpcGetMemHandle(&ipc, d1));
    CHECK(cuIpcOpenMemHandle(&opened, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    CHECK(cuMemcpyDtoH(ipc_back, opened + 64, 64));
    CHECK(cuIpcCloseMemHandle(opened));
    peer_ok &= memcmp(ipc_back, src + 64, 64) == 0;
    CHECK(cuMemFree(on1));
    CHECK(cuMemFree(pitched));

    CUdeviceptr mapped = 0;
    CHECK(cuMemHostGetDevicePointer(&mapped, src + 8, 0));
    unsigned flags = 0;
    CHECK(cuMemHostGetFlags(&flags, src));
    CUresult unregister_rc = cuMemHostUnregister(pageable);
    CUresult unregister_again = cuMemHostUnregister(pageable);
    CUresult register_twice = cuMemHostRegister(src, 4096, 0);
    CUresult free_pageable = cuMemFreeHost(pageable);
    CHECK(cuMemFreeHost(src));
    CHECK(cuMemFreeHost(back));
    if (huge)
        CHECK(cuMemFreeHost(huge));

    int p2p = -1, p2p_self = 0;
    CUresult p2p_rc = cuDeviceGetP2PAttribute(&p2p, CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, 0, 1);
    p2p_self = cuDeviceGetP2PAttribute(&p2p_self, CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, 0, 0);
    CUfunc_cache cache = CU_FUNC_CACHE_PREFER_NONE;
    CHECK(cuCtxSetCacheConfig(CU_FUNC_CACHE_PREFER_L1));
    CHECK(cuCtxGetCacheConfig(&cache));
    size_t stack = 0;
    CHECK(cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE));
    int least = 1, greatest = 1, prio = 1;
    CHECK(cuCtxGetStreamPriorityRange(&least, &greatest));
    CUstream ps;
    CHECK(cuStreamCreateWithPriority(&ps, 0, -100));
    CHECK(cuStreamGetPriority(ps, &prio));
    unsigned ctx_flags = 99;
    CHECK(cuCtxGetFlags(&ctx_flags));
    /* Unmodelled: a stub, as a driver without the feature answers. */
    char luid[8];
    unsigned luid_mask;
    CUresult stub = cuDeviceGetLuid(luid, &luid_mask, dev);
    CHECK(cuMemFree(d1));
    CHECK(cuMemFree(d2));
    CHECK(cuStreamDestroy(s));
    CHECK(cuStreamDestroy(ps));
    free(pageable);

    printf("{\"ok\": %d, \"first_fail_line\": %d, \"total\": %zu, \"free_before\": %zu, \"free_pinned\": %zu, "
           "\"free_device\": %zu, \"huge\": %d, \"roundtrip\": %d, \"past_end\": %d, \"mapped_is_host\": %d, "
           "\"flags\": %u, \"unregister\": [%d, %d], \"register_twice\": %d, \"free_pageable\": %d, "
           "\"p2p\": [%d, %d, %d], \"cache\": %d, \"stack\": %zu, \"priority\": [%d, %d, %d], \"ctx_flags\": %u, "
           "\"stub\": %d, \"types\": [%u, %u, %u], \"pool_used\": %llu, \"block_ok\": %d, \"array\": %d, "
           "\"d16_ok\": %d, \"peer_ok\": %d}\n",
           ok_count, first_fail_line, total, free0, free1, free2, huge_rc, roundtrip, past_end,
           mapped == (CUdeviceptr)(uintptr_t)(src + 8), flags, unregister_rc, unregister_again, register_twice,
           free_pageable, p2p_rc, p2p, p2p_self, cache, stack, least, greatest, prio, ctx_flags, stub, type_dev, type_pinned,
           type_pageable, (unsigned long long)pool_used, block_ok, array_rc, d16_ok, peer_ok);
    return 0;
}
