/* A tenant whose instance is resized while it runs. Reaches the driver by
 * dlopen and dlsym, as the CUDA runtime does, and takes one command a line
 * on stdin, answering each with one JSON line:
 *
 *   info        {"total": T, "free": F}            cuMemGetInfo
 *   alloc MIB   {"rc": "CUDA_...", "held": MIB}    one cuMemAlloc of MIB MiB
 *   fill MIB    {"chunks": N, "held": MIB}         MIB-sized cuMemAllocs until one fails
 *   free        {"held": 0}                        every allocation freed
 *   churn T MIB SECONDS  {"allocs": N, "refused": R}  T threads allocating and
 *               freeing MIB MiB as fast as they can, racing whatever resizes
 *               the instance meanwhile
 *   quit */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cgpu/cuda_abi.h"
#include "driver_dl.h"

#define MIB (1ULL << 20)
#define MAX_HELD 4096

static CUdeviceptr held[MAX_HELD];
static unsigned long long held_mib[MAX_HELD];
static unsigned n_held;

static const char *err(CUresult rc)
{
    const char *s = NULL;
    FN(cuGetErrorName)(rc, &s);
    return s ? s : "?";
}

static unsigned long long total_held(void)
{
    unsigned long long sum = 0;
    for (unsigned i = 0; i < n_held; i++)
        sum += held_mib[i];
    return sum;
}

static CUresult alloc(unsigned long long mib)
{
    if (n_held == MAX_HELD)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr p;
    CUresult rc = FN(cuMemAlloc_v2)(&p, (size_t)(mib * MIB));
    if (rc == CUDA_SUCCESS) {
        held[n_held] = p;
        held_mib[n_held++] = mib;
    }
    return rc;
}

struct churn {
    CUcontext ctx;
    unsigned long long mib;
    double seconds;
    _Atomic unsigned long long allocs, refused;
};

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void *churn_thread(void *arg)
{
    struct churn *c = arg;
    FN(cuCtxSetCurrent)(c->ctx);
    double end = now_s() + c->seconds;
    while (now_s() < end) {
        CUdeviceptr p;
        if (FN(cuMemAlloc_v2)(&p, (size_t)(c->mib * MIB)) == CUDA_SUCCESS) {
            atomic_fetch_add(&c->allocs, 1);
            FN(cuMemFree_v2)(p);
        } else {
            atomic_fetch_add(&c->refused, 1);
        }
    }
    return NULL;
}

static void churn(CUcontext ctx, unsigned threads, unsigned long long mib, double seconds)
{
    struct churn c = {.ctx = ctx, .mib = mib, .seconds = seconds};
    pthread_t t[64];
    unsigned n = threads < 64 ? threads : 64, started = 0;
    for (unsigned i = 0; i < n; i++)
        started += pthread_create(&t[started], NULL, churn_thread, &c) == 0;
    for (unsigned i = 0; i < started; i++)
        pthread_join(t[i], NULL);
    printf("{\"allocs\": %llu, \"refused\": %llu}\n", atomic_load(&c.allocs), atomic_load(&c.refused));
}

int main(void)
{
    driver_open();
    CUcontext ctx;
    if (FN(cuInit)(0) != CUDA_SUCCESS || FN(cuDevicePrimaryCtxRetain)(&ctx, 0) != CUDA_SUCCESS ||
        FN(cuCtxSetCurrent)(ctx) != CUDA_SUCCESS) {
        fprintf(stderr, "no context\n");
        return 3;
    }
    printf("{\"ready\": true}\n");
    fflush(stdout);
    char line[128];
    unsigned long long mib;
    unsigned threads;
    double seconds;
    while (fgets(line, sizeof(line), stdin)) {
        if (strncmp(line, "info", 4) == 0) {
            size_t f = 0, t = 0;
            CUresult rc = FN(cuMemGetInfo_v2)(&f, &t);
            printf("{\"rc\": \"%s\", \"total\": %zu, \"free\": %zu}\n", err(rc), t, f);
        } else if (sscanf(line, "alloc %llu", &mib) == 1) {
            CUresult rc = alloc(mib);
            printf("{\"rc\": \"%s\", \"held\": %llu}\n", err(rc), total_held());
        } else if (sscanf(line, "fill %llu", &mib) == 1 && mib > 0) {
            unsigned chunks = 0;
            while (alloc(mib) == CUDA_SUCCESS)
                chunks++;
            printf("{\"chunks\": %u, \"held\": %llu}\n", chunks, total_held());
        } else if (sscanf(line, "churn %u %llu %lf", &threads, &mib, &seconds) == 3) {
            churn(ctx, threads, mib, seconds);
        } else if (strncmp(line, "free", 4) == 0) {
            while (n_held)
                FN(cuMemFree_v2)(held[--n_held]);
            printf("{\"held\": 0}\n");
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        } else {
            printf("{\"error\": \"unknown command\"}\n");
        }
        fflush(stdout);
    }
    while (n_held)
        FN(cuMemFree_v2)(held[--n_held]);
    return 0;
}
