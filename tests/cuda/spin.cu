// The portable spin kernel built by nvcc and driven through the CUDA
// runtime (tests/integration/test_cudart.py): each step prints one line
// "<step> <cudaError name> [values]" so the test reads how far cudart got
// and what it saw. argv: the steps to run, in order.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

// The spin kernel: its cost is known without knowing the GPU, as the
// driver-API workload's cgpu_spin.
#include "spin_kernel.cu"
#include "steps.h"

static void report(const char *step, cudaError_t rc, const char *fmt = "", unsigned long long a = 0,
                   unsigned long long b = 0)
{
    printf("%s %s", step, cudaGetErrorName(rc));
    if (*fmt) {
        printf(" ");
        printf(fmt, a, b);
    }
    printf("\n");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        if (!strcmp(s, "count")) {
            int n = -1;
            cudaError_t rc = cudaGetDeviceCount(&n);
            report(s, rc, "%llu", (unsigned long long)n);
        } else if (!strcmp(s, "meminfo")) {
            size_t free_b = 0, total = 0;
            cudaError_t rc = cudaMemGetInfo(&free_b, &total);
            report(s, rc, "%llu %llu", free_b, total);
        } else if (!strcmp(s, "malloc") || !strcmp(s, "managed")) {
            // 64 MiB of device or managed memory, then freed
            void *p = nullptr;
            cudaError_t rc = !strcmp(s, "managed") ? cudaMallocManaged(&p, 64 << 20) : cudaMalloc(&p, 64 << 20);
            report(s, rc);
            if (!rc)
                report("free", cudaFree(p));
        } else if (!strcmp(s, "async")) {
            void *p = nullptr;
            cudaError_t rc = cudaMallocAsync(&p, 64 << 20, 0);
            report(s, rc);
            if (!rc) {
                rc = cudaFreeAsync(p, 0);
                if (!rc)
                    rc = cudaStreamSynchronize(0);
                report("freeasync", rc);
            }
        } else if (!strcmp(s, "fill")) {
            // cudaMalloc 64 MiB blocks until it fails: what the limit lets through.
            unsigned long long held = 0;
            cudaError_t rc = cudaSuccess;
            for (;;) {
                void *p = nullptr;
                rc = cudaMalloc(&p, 64 << 20);
                if (rc)
                    break;
                held += 64 << 20;
            }
            report(s, rc, "%llu", held);
        } else if (!strcmp(s, "asyncfill") || !strcmp(s, "poolfill")) {
            // cudaMallocAsync 64 MiB blocks from the device's default pool, or
            // from a pool of its own, until it fails; then all back
            cudaMemPool_t pool = nullptr;
            cudaError_t rc = cudaSuccess;
            if (s[0] == 'p') {
                cudaMemPoolProps props = {};
                props.allocType = cudaMemAllocationTypePinned;
                props.location.type = cudaMemLocationTypeDevice;
                props.location.id = 0;
                rc = cudaMemPoolCreate(&pool, &props);
            }
            void *held[1024];
            unsigned n = 0;
            while (!rc && n < 1024) {
                rc = pool ? cudaMallocFromPoolAsync(&held[n], 64 << 20, pool, 0) : cudaMallocAsync(&held[n], 64 << 20, 0);
                if (!rc)
                    rc = cudaStreamSynchronize(0);
                if (!rc)
                    n++;
            }
            report(s, rc, "%llu", (unsigned long long)n * (64 << 20));
            cudaGetLastError();
            for (unsigned i = 0; i < n; i++)
                cudaFreeAsync(held[i], 0);
            cudaStreamSynchronize(0);
            if (pool)
                cudaMemPoolDestroy(pool);
        } else if (!strcmp(s, "kernel")) {
            // one 50 ms kernel, timed on the host
            cudaGetLastError(); // a failed step before must not stop this one
            double t0 = now_s();
            cgpu_spin<<<1, 1>>>(50000000ULL);
            cudaError_t rc = cudaGetLastError();
            if (!rc)
                rc = cudaDeviceSynchronize();
            report(s, rc, "%llu", (unsigned long long)((now_s() - t0) * 1e6));
        } else if (!strncmp(s, "burn=", 5)) {
            // 10 ms kernels for the given seconds: the share the GPU gave
            cudaGetLastError();
            double secs = atof(s + 5), t0 = now_s();
            unsigned long long n = 0;
            cudaError_t rc = cudaSuccess;
            while (!rc && now_s() - t0 < secs) {
                cgpu_spin<<<1, 1>>>(10000000ULL);
                rc = cudaGetLastError();
                if (!rc && ++n % 4 == 0)
                    rc = cudaDeviceSynchronize();
            }
            if (!rc)
                rc = cudaDeviceSynchronize();
            report("burn", rc, "%llu %llu", n * 10000000ULL, (unsigned long long)((now_s() - t0) * 1e9));
        } else if (!strcmp(s, "graph")) {
            // a graph of two 20 ms kernel nodes built node by node, launched once
            cudaGraph_t g = nullptr;
            cudaGraphNode_t a, b;
            unsigned long long ns = 20000000ULL;
            void *args[] = {&ns};
            cudaKernelNodeParams p = {};
            p.func = (void *)cgpu_spin;
            p.gridDim = dim3(1);
            p.blockDim = dim3(1);
            p.kernelParams = args;
            cudaError_t rc = cudaGraphCreate(&g, 0);
            if (!rc)
                rc = cudaGraphAddKernelNode(&a, g, nullptr, 0, &p);
            if (!rc)
                rc = cudaGraphAddKernelNode(&b, g, &a, 1, &p);
            unsigned long long us = 0;
            rc = launch_graph_once(rc, g, 0, &us);
            report(s, rc, "%llu", us);
        } else if (!strcmp(s, "attrs")) {
            // what frameworks ask of a kernel before launching it
            cudaFuncAttributes fa = {};
            int min_grid = 0, block = 0;
            cudaError_t rc = cudaFuncGetAttributes(&fa, cgpu_spin);
            if (!rc)
                rc = cudaFuncSetAttribute(cgpu_spin, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
            if (!rc)
                rc = cudaOccupancyMaxPotentialBlockSize(&min_grid, &block, cgpu_spin, 0, 0);
            report(s, rc, "%llu %llu", (unsigned long long)fa.maxThreadsPerBlock, (unsigned long long)block);
        } else if (!strcmp(s, "copy")) {
            // bytes through device memory and back
            int in[256], out[256] = {0}, *d = nullptr;
            for (int k = 0; k < 256; k++)
                in[k] = k * 7;
            cudaError_t rc = cudaMalloc(&d, sizeof(in));
            if (!rc)
                rc = cudaMemcpy(d, in, sizeof(in), cudaMemcpyHostToDevice);
            if (!rc)
                rc = cudaMemcpy(out, d, sizeof(out), cudaMemcpyDeviceToHost);
            report(s, rc, "%llu", (unsigned long long)!memcmp(in, out, sizeof(in)));
            cudaFree(d);
        } else if (!strncmp(s, "device=", 7)) {
            report("device", cudaSetDevice(atoi(s + 7)));
        } else if (!strcmp(s, "reset")) {
            report(s, cudaDeviceReset());
        } else if (!strcmp(s, "capture")) {
            // two 20 ms kernels captured from a stream into a graph, launched once
            cudaStream_t st;
            cudaGraph_t g = nullptr;
            cudaStreamCaptureStatus during = cudaStreamCaptureStatusNone;
            cudaError_t rc = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
            if (!rc)
                rc = cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
            if (!rc) {
                cgpu_spin<<<1, 1, 0, st>>>(20000000ULL);
                cgpu_spin<<<1, 1, 0, st>>>(20000000ULL);
                rc = cudaStreamIsCapturing(st, &during);
            }
            if (!rc)
                rc = cudaStreamEndCapture(st, &g);
            unsigned long long us = 0;
            rc = launch_graph_once(rc, g, st, &us);
            report(s, rc, "%llu %llu", us, (unsigned long long)(during == cudaStreamCaptureStatusActive));
        } else {
            fprintf(stderr, "unknown step %s\n", s);
            return 2;
        }
    }
    return 0;
}
