/* A tenant that maps a handle it holds while another of its threads
 * releases that handle and creates a bigger allocation, which the driver
 * tends to give the released value: if the map reaches the driver after
 * that create, it maps the big memory while libcgpu took the mapping's
 * reference on the small one; releasing the big handle then gives its
 * bytes back while the mapping keeps them alive (a way past the limit).
 *
 * Each attempt: the main thread creates SMALL and marks it (SMALL_MARK in
 * its first word), publishes the handle and, once the other thread is
 * about to act, maps it at its slot after a random short spin. The other
 * thread stops the main thread wherever it is for a while (a signal whose
 * handler sleeps, as a descheduled thread would), releases the handle,
 * creates BIG and marks it, waits until the map has returned and releases
 * BIG. With the mapping in place and both handles released, the main
 * thread reads the mapping's first word: BIG_MARK with the charge grown by
 * less than BIG is an escape (BIG alive, not charged). Then it unmaps.
 * Prints {"attempts": A, "maps": M, "reused": R, "big_maps": B,
 * "escapes": E, "charged_end": C, "total": T}: R creates of BIG that got
 * the published value, B maps that mapped BIG. Reaches the driver by
 * dlopen and dlsym, as the CUDA runtime does. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cgpu/cuda_abi.h"
#include "driver_dl.h"

#define ATTEMPTS 4000
#define SMALL ((size_t)2 << 20)
#define BIG ((size_t)64 << 20)
#define SMALL_MARK 0x5a11u
#define BIG_MARK 0xb16b16u

enum { IDLE, PUBLISHED, GO, SWAPPED, MAPPED, QUIT };

static CUcontext ctx;
static pthread_t mapper;
static _Atomic CUmemGenericAllocationHandle target;
static atomic_int phase;
static atomic_int reused;

static void pause_here(int sig)
{
    (void)sig;
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
}

/* From none to a few thousand, log-uniform: the two threads meet at every
 * offset, from the map long done before the release to long after it. */
static unsigned spin_count(unsigned *seed)
{
    return (unsigned)rand_r(seed) % (1u << (rand_r(seed) % 13));
}

static int await(int want)
{
    int p;
    while ((p = atomic_load(&phase)) != want && p != QUIT)
        sched_yield();
    return p;
}

/* GO may have passed already: the other thread does not wait for it to be seen. */
static void await_go(void)
{
    while (atomic_load(&phase) < GO)
        sched_yield();
}

static const CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                         .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};

/* Writes `mark` into the first word of the handle's memory through a
 * mapping of its own at `va`, then unmaps it. */
static void mark(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle h, unsigned mark)
{
    if (FN(cuMemMap)(va, size, 0, h, 0) != CUDA_SUCCESS)
        return;
    CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    FN(cuMemSetAccess)(va, size, &access, 1);
    FN(cuMemsetD32_v2)(va, mark, 1);
    FN(cuMemUnmap)(va, size);
}

static void *swapper(void *arg)
{
    CUdeviceptr scratch = (CUdeviceptr)(uintptr_t)arg;
    FN(cuCtxSetCurrent)(ctx);
    __typeof__(&cuMemCreate) create = FN(cuMemCreate);
    __typeof__(&cuMemRelease) release = FN(cuMemRelease);
    unsigned seed = 2;
    while (await(PUBLISHED) != QUIT) {
        CUmemGenericAllocationHandle h = atomic_load(&target), big = 0;
        atomic_store(&phase, GO);
        pthread_kill(mapper, SIGUSR1);
        for (volatile unsigned spin = spin_count(&seed); spin; spin--)
            ;
        release(h);
        int made = create(&big, BIG, &prop, 0) == CUDA_SUCCESS;
        if (made) {
            atomic_fetch_add(&reused, big == h);
            mark(scratch, BIG, big, BIG_MARK);
        }
        atomic_store(&phase, SWAPPED);
        if (await(MAPPED) == QUIT)
            break;
        if (made)
            release(big);
        atomic_store(&phase, IDLE);
    }
    return NULL;
}

int main(void)
{
    driver_open();
    CUdevice dev;
    CUdeviceptr slot, scratch, big_scratch;
    if (FN(cuInit)(0) != CUDA_SUCCESS || FN(cuDeviceGet)(&dev, 0) != CUDA_SUCCESS ||
        FN(cuDevicePrimaryCtxRetain)(&ctx, dev) != CUDA_SUCCESS || FN(cuCtxSetCurrent)(ctx) != CUDA_SUCCESS ||
        FN(cuMemAddressReserve)(&slot, SMALL, 0, 0, 0) != CUDA_SUCCESS ||
        FN(cuMemAddressReserve)(&scratch, SMALL, 0, 0, 0) != CUDA_SUCCESS ||
        FN(cuMemAddressReserve)(&big_scratch, BIG, 0, 0, 0) != CUDA_SUCCESS) {
        fprintf(stderr, "setup failed\n");
        return 2;
    }
    __typeof__(&cuMemCreate) create = FN(cuMemCreate);
    __typeof__(&cuMemMap) map = FN(cuMemMap);
    struct sigaction sa = {.sa_handler = pause_here};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    mapper = pthread_self();
    pthread_t t;
    if (pthread_create(&t, NULL, swapper, (void *)(uintptr_t)big_scratch) != 0)
        return 2;
    int maps = 0, attempts = 0, big_maps = 0, escapes = 0;
    unsigned seed = 1;
    CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    while (attempts < ATTEMPTS) {
        size_t before = charged();
        CUmemGenericAllocationHandle h = 0;
        if (create(&h, SMALL, &prop, 0) != CUDA_SUCCESS) {
            fprintf(stderr, "cannot create %zu bytes with %zu charged\n", SMALL, before);
            return 4;
        }
        mark(scratch, SMALL, h, SMALL_MARK);
        attempts++;
        atomic_store(&target, h);
        atomic_store(&phase, PUBLISHED);
        await_go();
        /* The signal lands somewhere else in the map each time. */
        for (volatile unsigned spin = spin_count(&seed); spin; spin--)
            ;
        CUresult rc = map(slot, SMALL, 0, h, 0);
        await(SWAPPED);
        atomic_store(&phase, MAPPED);
        await(IDLE);
        if (rc != CUDA_SUCCESS)
            continue;
        maps++;
        unsigned word = 0;
        FN(cuMemSetAccess)(slot, SMALL, &access, 1);
        FN(cuMemcpyDtoH_v2)(&word, slot, sizeof word);
        if (word == BIG_MARK) {
            big_maps++;
            escapes += charged() < before + BIG;
        }
        FN(cuMemUnmap)(slot, SMALL);
    }
    atomic_store(&phase, QUIT);
    pthread_join(t, NULL);
    size_t free_b = 0, total = 0;
    if (FN(cuMemGetInfo_v2)(&free_b, &total) != CUDA_SUCCESS)
        return 3;
    printf("{\"attempts\": %d, \"maps\": %d, \"reused\": %d, \"big_maps\": %d, \"escapes\": %d, \"charged_end\": %zu, "
           "\"total\": %zu}\n",
           attempts, maps, atomic_load(&reused), big_maps, escapes, total - free_b, total);
    return 0;
}
