/* A tenant that maps VMM handles it guessed, racing the thread that makes
 * them: one thread runs CYCLES x (cuMemCreate 2 MiB, publish the handle,
 * cuMemRelease), so the driver tends to hand the same value out again at
 * the next create; another maps the last published value over and over,
 * each success at a fresh 2 MiB slot of its reserved range (up to SLOTS),
 * (each handle once), and so hits a value while the next create is between the driver and
 * libcgpu's record of it (or a release between libcgpu's bookkeeping and
 * the driver), if libcgpu lets such a map through. After every
 * successful map, and at the end (every handle released, the mappings
 * kept), the process's charge (limit - free from cuMemGetInfo) is compared
 * with what it has mapped. The race ends after ATTEMPTS maps were tried,
 * SLOTS succeeded, or CYCLES creates. Prints {"cycles": C, "attempts": A,
 * "mapped": M, "maps": S,
 * "short": N, "charged_end": B, "total": T}: S successful maps, N times
 * the charge was seen below what was mapped. Reaches the driver by dlopen
 * and dlsym, as the CUDA runtime does. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cgpu/cuda_abi.h"
#include "driver_dl.h"

#define CYCLES 2000000 /* at most */
#define ATTEMPTS 200000 /* maps tried before the race ends */
#define SLOTS 32
#define SIZE ((size_t)2 << 20)

static CUcontext ctx;
static _Atomic CUmemGenericAllocationHandle guess;
static atomic_bool done;
static atomic_int cycles_run;
static pthread_barrier_t start;

/* Stops the creating thread wherever it is for a while: now and then
 * inside libcgpu's bookkeeping, which widens the race's window as a
 * descheduled thread would. */
static void pause_here(int sig)
{
    (void)sig;
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
}

static void *creator(void *arg)
{
    (void)arg;
    FN(cuCtxSetCurrent)(ctx);
    __typeof__(&cuMemCreate) create = FN(cuMemCreate);
    __typeof__(&cuMemRelease) release = FN(cuMemRelease);
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    pthread_barrier_wait(&start);
    for (int i = 0; i < CYCLES && !atomic_load(&done); i++) {
        CUmemGenericAllocationHandle h = 0;
        if (create(&h, SIZE, &prop, 0) != CUDA_SUCCESS)
            continue; /* out of memory: the mapped ones are charged */
        atomic_store(&guess, h);
        release(h);
        atomic_fetch_add(&cycles_run, 1);
    }
    atomic_store(&done, true);
    return NULL;
}

int main(void)
{
    driver_open();
    CUdevice dev;
    CUdeviceptr va;
    if (FN(cuInit)(0) != CUDA_SUCCESS || FN(cuDeviceGet)(&dev, 0) != CUDA_SUCCESS ||
        FN(cuDevicePrimaryCtxRetain)(&ctx, dev) != CUDA_SUCCESS || FN(cuCtxSetCurrent)(ctx) != CUDA_SUCCESS ||
        FN(cuMemAddressReserve)(&va, SLOTS * SIZE, 0, 0, 0) != CUDA_SUCCESS) {
        fprintf(stderr, "setup failed\n");
        return 2;
    }
    __typeof__(&cuMemMap) map = FN(cuMemMap);
    pthread_t t;
    struct sigaction sa = {.sa_handler = pause_here};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    pthread_barrier_init(&start, NULL, 2);
    if (pthread_create(&t, NULL, creator, NULL) != 0)
        return 2;
    pthread_barrier_wait(&start);
    int maps = 0, shortfalls = 0;
    long attempts = 0;
    /* Each handle mapped once: its memory cannot be freed (nor its value
     * handed out again) while mapped, so every mapping is memory of its own. */
    CUmemGenericAllocationHandle mapped[SLOTS];
    while (!atomic_load(&done) && maps < SLOTS && attempts < ATTEMPTS) {
        CUmemGenericAllocationHandle g = atomic_load(&guess);
        int seen = 0;
        for (int i = 0; i < maps; i++)
            seen |= mapped[i] == g;
        if (!g || seen)
            continue;
        if (attempts++ % 4 == 0)
            pthread_kill(t, SIGUSR1);
        if (map(va + (CUdeviceptr)maps * SIZE, SIZE, 0, g, 0) != CUDA_SUCCESS)
            continue;
        mapped[maps++] = g;
        shortfalls += charged() < (size_t)maps * SIZE;
    }
    atomic_store(&done, true);
    pthread_join(t, NULL);
    size_t end = charged();
    shortfalls += end < (size_t)maps * SIZE;
    size_t free_b = 0, total = 0;
    FN(cuMemGetInfo_v2)(&free_b, &total);
    printf("{\"cycles\": %d, \"attempts\": %ld, \"mapped\": %zu, \"maps\": %d, \"short\": %d, \"charged_end\": %zu, \"total\": %zu}\n",
           atomic_load(&cycles_run), attempts, (size_t)maps * SIZE, maps, shortfalls, end, total);
    return 0;
}
