/* Threads of one process racing VMM cycles: holds one plain allocation of
 * HELD_MIB and one VMM handle of 2 MiB everybody maps, then THREADS threads
 * each run CYCLES x (cuMemCreate 2 MiB, cuMemMap into its own reserved
 * range, cuMemRetainAllocationHandle on the mapping, cuMemRelease of both
 * handles, cuMemUnmap; then map and unmap the shared handle at a second
 * range of its own), all at once. Each thread ends with one more 2 MiB
 * mapped and its handle released: still charged. Prints
 * {"errors": N, "first_error": "...", "free_held": F1, "free": F2,
 * "total": T}: cuMemGetInfo once every thread is done (F1), then after
 * the shared handle is released and the threads' last mappings unmapped
 * (F2). Reaches the driver by dlopen
 * and dlsym, as the CUDA runtime does. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "cgpu/cuda_abi.h"
#include "driver_dl.h"

#define THREADS 8
#define CYCLES 2000
#define HELD_MIB 100
#define SIZE ((size_t)2 << 20)

static CUcontext ctx;
static CUmemGenericAllocationHandle shared;
static CUdeviceptr kept_va[THREADS];
static atomic_int errors;
static const char *_Atomic first_error;
static pthread_barrier_t start;

static void check(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS && atomic_fetch_add(&errors, 1) == 0)
        atomic_store(&first_error, what);
}

static void *cycles(void *arg)
{
    int me = (int)(intptr_t)arg;
    check(FN(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    CUdeviceptr va = 0, va2 = 0;
    check(FN(cuMemAddressReserve)(&va, SIZE, 0, 0, 0), "cuMemAddressReserve");
    check(FN(cuMemAddressReserve)(&va2, SIZE, 0, 0, 0), "cuMemAddressReserve");
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    pthread_barrier_wait(&start);
    for (int i = 0; i < CYCLES; i++) {
        CUmemGenericAllocationHandle h = 0, again = 0;
        check(FN(cuMemCreate)(&h, SIZE, &prop, 0), "cuMemCreate");
        check(FN(cuMemMap)(va, SIZE, 0, h, 0), "cuMemMap");
        check(FN(cuMemRetainAllocationHandle)(&again, (void *)(uintptr_t)va), "cuMemRetainAllocationHandle");
        check(FN(cuMemRelease)(h), "cuMemRelease");
        check(FN(cuMemRelease)(again), "cuMemRelease (retained)");
        check(FN(cuMemUnmap)(va, SIZE), "cuMemUnmap");
        check(FN(cuMemMap)(va2, SIZE, 0, shared, 0), "cuMemMap (shared)");
        check(FN(cuMemUnmap)(va2, SIZE), "cuMemUnmap (shared)");
    }
    /* memory that a mapping alone keeps alive */
    CUmemGenericAllocationHandle last = 0;
    check(FN(cuMemCreate)(&last, SIZE, &prop, 0), "cuMemCreate (kept)");
    check(FN(cuMemMap)(va, SIZE, 0, last, 0), "cuMemMap (kept)");
    check(FN(cuMemRelease)(last), "cuMemRelease (kept)");
    kept_va[me] = va;
    check(FN(cuMemAddressFree)(va2, SIZE), "cuMemAddressFree");
    return NULL;
}

int main(void)
{
    driver_open();
    CUdevice dev;
    CUdeviceptr held;
    if (FN(cuInit)(0) != CUDA_SUCCESS || FN(cuDeviceGet)(&dev, 0) != CUDA_SUCCESS ||
        FN(cuDevicePrimaryCtxRetain)(&ctx, dev) != CUDA_SUCCESS || FN(cuCtxSetCurrent)(ctx) != CUDA_SUCCESS ||
        FN(cuMemAlloc_v2)(&held, (size_t)HELD_MIB << 20) != CUDA_SUCCESS) {
        fprintf(stderr, "setup failed\n");
        return 2;
    }
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    if (FN(cuMemCreate)(&shared, SIZE, &prop, 0) != CUDA_SUCCESS) {
        fprintf(stderr, "setup failed\n");
        return 2;
    }
    pthread_t t[THREADS];
    pthread_barrier_init(&start, NULL, THREADS);
    for (int i = 0; i < THREADS; i++)
        if (pthread_create(&t[i], NULL, cycles, (void *)(intptr_t)i) != 0)
            return 2;
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    size_t free_held = 0, free_b = 0, total = 0;
    check(FN(cuMemGetInfo_v2)(&free_held, &total), "cuMemGetInfo_v2");
    check(FN(cuMemRelease)(shared), "cuMemRelease (shared)");
    for (int i = 0; i < THREADS; i++) {
        check(FN(cuMemUnmap)(kept_va[i], SIZE), "cuMemUnmap (kept)");
        check(FN(cuMemAddressFree)(kept_va[i], SIZE), "cuMemAddressFree (kept)");
    }
    check(FN(cuMemGetInfo_v2)(&free_b, &total), "cuMemGetInfo_v2");
    const char *first = atomic_load(&first_error);
    printf("{\"errors\": %d, \"first_error\": \"%s\", \"free_held\": %zu, \"free\": %zu, \"total\": %zu}\n",
           atomic_load(&errors), first ? first : "", free_held, free_b, total);
    return 0;
}
