/* The CUDA runtime API from plain C, built by the host compiler against
 * any runtime line's headers (12.9, 13.x), shared or static cudart
 * (tests/integration/test_cuda_runtimes.py). Kernels come from a file nvcc
 * made, a fatbin or PTX, through cudaLibraryLoadData: no nvcc of the
 * runtime's own line is needed (PyPI has none for 12.x). Each step prints
 * one line "<step> <cudaError name> [values]"; argv: the steps in order. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>

#include "steps.h"

static cudaKernel_t spin;
static cudaStream_t stream;

static void report(const char *step, cudaError_t rc)
{
    printf("%s %s", step, cudaGetErrorName(rc));
}

static void end(void)
{
    printf("\n");
    fflush(stdout);
}

/* The file whole and NUL-terminated (PTX is text). */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *grown = realloc(buf, 2 * cap + 1);
            if (!grown) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = grown;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf)
        buf[n] = '\0';
    return buf;
}

static cudaError_t launch_spin(unsigned long long ns, cudaStream_t st)
{
    void *args[] = {&ns};
    dim3 one = {1, 1, 1};
    return cudaLaunchKernel((const void *)spin, one, one, args, 0, st);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        cudaError_t rc;
        if (!strcmp(s, "version")) {
            int driver = 0, runtime = 0;
            rc = cudaDriverGetVersion(&driver);
            if (!rc)
                rc = cudaRuntimeGetVersion(&runtime);
            report(s, rc);
            printf(" %d %d", driver, runtime);
        } else if (!strcmp(s, "count")) {
            int n = -1;
            rc = cudaGetDeviceCount(&n);
            report(s, rc);
            printf(" %d", n);
        } else if (!strcmp(s, "props")) {
            struct cudaDeviceProp p;
            memset(&p, 0, sizeof(p));
            rc = cudaGetDeviceProperties(&p, 0);
            report(s, rc);
            printf(" %d.%d %d %zu", p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem);
        } else if (!strcmp(s, "meminfo")) {
            size_t free_b = 0, total = 0;
            rc = cudaMemGetInfo(&free_b, &total);
            report(s, rc);
            printf(" %zu %zu", free_b, total);
        } else if (!strcmp(s, "fill")) {
            /* 64 MiB blocks until refused: what the limit lets through */
            unsigned long long held = 0;
            void *p;
            while ((rc = cudaMalloc(&p, 64u << 20)) == cudaSuccess)
                held += 64u << 20;
            report(s, rc);
            printf(" %llu", held);
            cudaGetLastError();
        } else if (!strncmp(s, "load=", 5)) {
            /* a fatbin or PTX file from nvcc; the kernel by its C name */
            char *code = slurp(s + 5);
            cudaLibrary_t lib;
            rc = code ? cudaLibraryLoadData(&lib, code, NULL, NULL, 0, NULL, NULL, 0) : cudaErrorInvalidValue;
            if (!rc)
                rc = cudaLibraryGetKernel(&spin, lib, "cgpu_spin");
            if (!rc)
                rc = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
            report("load", rc);
            free(code);
        } else if (!strcmp(s, "kernel")) {
            /* one 50 ms kernel on the legacy stream, timed on the host */
            double t0 = now_s();
            rc = launch_spin(50000000ULL, 0);
            if (!rc)
                rc = cudaDeviceSynchronize();
            report(s, rc);
            printf(" %llu", (unsigned long long)((now_s() - t0) * 1e6));
        } else if (!strcmp(s, "events")) {
            /* a 20 ms kernel on a stream of its own between two events */
            cudaEvent_t a, b;
            float ms = 0;
            rc = cudaEventCreate(&a);
            if (!rc)
                rc = cudaEventCreate(&b);
            if (!rc)
                rc = cudaEventRecord(a, stream);
            if (!rc)
                rc = launch_spin(20000000ULL, stream);
            if (!rc)
                rc = cudaEventRecord(b, stream);
            if (!rc)
                rc = cudaEventSynchronize(b);
            if (!rc)
                rc = cudaEventElapsedTime(&ms, a, b);
            report(s, rc);
            printf(" %llu", (unsigned long long)(ms * 1000));
        } else if (!strcmp(s, "graph")) {
            /* two 20 ms kernels captured from the stream, launched once */
            cudaGraph_t g = NULL;
            unsigned long long us = 0;
            rc = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
            if (!rc)
                rc = launch_spin(20000000ULL, stream);
            if (!rc)
                rc = launch_spin(20000000ULL, stream);
            if (!rc)
                rc = cudaStreamEndCapture(stream, &g);
            rc = launch_graph_once(rc, g, stream, &us);
            report(s, rc);
            printf(" %llu", us);
        } else if (!strncmp(s, "burn=", 5)) {
            /* 10 ms kernels for the given seconds: the share the GPU gave */
            double secs = atof(s + 5), t0 = now_s();
            unsigned long long n = 0;
            rc = cudaSuccess;
            while (!rc && now_s() - t0 < secs) {
                rc = launch_spin(10000000ULL, 0);
                if (!rc && ++n % 4 == 0)
                    rc = cudaDeviceSynchronize();
            }
            if (!rc)
                rc = cudaDeviceSynchronize();
            report("burn", rc);
            printf(" %llu %llu", n * 10000000ULL, (unsigned long long)((now_s() - t0) * 1e9));
        } else {
            fprintf(stderr, "unknown step %s\n", s);
            return 2;
        }
        end();
    }
    return 0;
}
