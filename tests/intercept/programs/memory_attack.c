/* A tenant trying to hold more device memory than its instance grants,
 * through documented driver calls only. Reaches the driver by dlopen and
 * dlsym, as the CUDA runtime does, and prints one JSON object per phase.
 * Between phases it waits for a line on stdin, or with GO_DIR set for the
 * file GO_DIR/go<phase> (a container's stdin is not the test's).
 *
 *   memory_attack vmm       create/reserve/map twice/release x 8 of 512 MiB,
 *                           then unmap the first mappings, then the second;
 *                           then create/map/unmap x 2, then release
 *   memory_attack retain    create/map/retain/release/unmap: the retained
 *                           handle alone keeps 512 MiB
 *   memory_attack export    create 512 MiB, export, release; exec an importer
 *   memory_attack import FD PIPE  (the importer, once the exporter is gone)
 *   memory_attack graph     graph memory-allocation nodes of 2 GiB
 *   memory_attack limits    cuCtxSetLimit heap and stack
 *   memory_attack oldabi    the v1 entry points a pre-3.2 runtime is handed */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cgpu/cuda_abi.h"
#include "driver_dl.h"

#define MIB (1ULL << 20)
#define CHUNK (512 * MIB)


static const char *err(CUresult rc)
{
    const char *s = NULL;
    FN(cuGetErrorName)(rc, &s);
    return s ? s : "?";
}

static void must(CUresult rc, const char *what)
{
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "%s: %s\n", what, err(rc));
        exit(3);
    }
}

static void wait_go(int phase)
{
    const char *dir = getenv("GO_DIR");
    char path[512], line[64];
    fflush(stdout);
    if (!dir) {
        if (!fgets(line, sizeof(line), stdin))
            exit(4);
        return;
    }
    snprintf(path, sizeof(path), "%s/go%d", dir, phase);
    for (int i = 0; i < 1200 && access(path, F_OK) != 0; i++) { /* 120 s */
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static void init(void)
{
    CUcontext ctx;
    must(FN(cuInit)(0), "cuInit");
    must(FN(cuDevicePrimaryCtxRetain)(&ctx, 0), "retain");
    must(FN(cuCtxSetCurrent)(ctx), "set current");
}

static unsigned long long mem_free(void)
{
    size_t f = 0, t = 0;
    must(FN(cuMemGetInfo_v2)(&f, &t), "cuMemGetInfo_v2");
    return f;
}

static CUmemAllocationProp device_prop(CUmemAllocationHandleType types)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof(p));
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = types;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
}

static int vmm(void)
{
    CUmemAllocationProp prop = device_prop(CU_MEM_HANDLE_TYPE_NONE);
    CUdeviceptr va[8][2];
    int mapped = 0;
    printf("{\"phase\":1,\"creates\":[");
    for (int i = 0; i < 8; i++) {
        CUmemGenericAllocationHandle h;
        CUresult rc = FN(cuMemCreate)(&h, CHUNK, &prop, 0);
        printf("%s\"%s\"", i ? "," : "", err(rc));
        if (rc != CUDA_SUCCESS)
            continue;
        for (int m = 0; m < 2; m++) {
            must(FN(cuMemAddressReserve)(&va[mapped][m], CHUNK, 0, 0, 0), "reserve");
            must(FN(cuMemMap)(va[mapped][m], CHUNK, 0, h, 0), "map");
        }
        must(FN(cuMemRelease)(h), "release"); /* the mappings keep it alive */
        mapped++;
    }
    printf("],\"free\":%llu}\n", mem_free());
    wait_go(1);
    for (int i = 0; i < mapped; i++)
        must(FN(cuMemUnmap)(va[i][0], CHUNK), "unmap first");
    printf("{\"phase\":2,\"free\":%llu}\n", mem_free());
    wait_go(2);
    for (int i = 0; i < mapped; i++)
        must(FN(cuMemUnmap)(va[i][1], CHUNK), "unmap second");
    CUmemGenericAllocationHandle h[2];
    CUresult again[2];
    unsigned long long after = mem_free();
    for (int i = 0; i < 2; i++)
        again[i] = FN(cuMemCreate)(&h[i], CHUNK, &prop, 0);
    printf("{\"phase\":3,\"free\":%llu,\"again\":[\"%s\",\"%s\"]}\n", after, err(again[0]), err(again[1]));
    /* The other order: unmapped first, the handles keep the memory. */
    for (int i = 0; i < 2; i++) {
        CUdeviceptr v;
        must(FN(cuMemAddressReserve)(&v, CHUNK, 0, 0, 0), "reserve");
        must(FN(cuMemMap)(v, CHUNK, 0, h[i], 0), "map");
        must(FN(cuMemUnmap)(v, CHUNK), "unmap");
    }
    printf("{\"phase\":4,\"free\":%llu}\n", mem_free());
    wait_go(4);
    for (int i = 0; i < 2; i++)
        must(FN(cuMemRelease)(h[i]), "release");
    printf("{\"phase\":5,\"free\":%llu}\n", mem_free());
    return 0;
}

/* A handle retained through its mapping is a reference of its own. */
static int retain(void)
{
    CUmemAllocationProp prop = device_prop(CU_MEM_HANDLE_TYPE_NONE);
    CUmemGenericAllocationHandle h, again, more[2];
    CUdeviceptr va;
    must(FN(cuMemCreate)(&h, CHUNK, &prop, 0), "create");
    must(FN(cuMemAddressReserve)(&va, CHUNK, 0, 0, 0), "reserve");
    must(FN(cuMemMap)(va, CHUNK, 0, h, 0), "map");
    must(FN(cuMemRetainAllocationHandle)(&again, (void *)(uintptr_t)va), "retain");
    must(FN(cuMemRelease)(h), "release");
    must(FN(cuMemUnmap)(va, CHUNK), "unmap");
    unsigned long long held = mem_free();
    CUresult rc[2];
    for (int i = 0; i < 2; i++)
        rc[i] = FN(cuMemCreate)(&more[i], CHUNK, &prop, 0);
    must(FN(cuMemRelease)(again), "release retained");
    printf("{\"same_handle\":%s,\"free_retained\":%llu,\"creates\":[\"%s\",\"%s\"],\"free_released\":%llu}\n",
           again == h ? "true" : "false", held, err(rc[0]), err(rc[1]), mem_free());
    for (int i = 0; i < 2; i++)
        if (rc[i] == CUDA_SUCCESS)
            FN(cuMemRelease)(more[i]);
    return 0;
}

/* The orders of release, unmap and retain that leave a handle's memory
 * mapped after its handle is gone, each ending with everything freed,
 * beside a plain allocation that stays: each figure is exact only if
 * every byte is charged once and given back once. */
static int vmm_orders(void)
{
    CUmemAllocationProp prop = device_prop(CU_MEM_HANDLE_TYPE_NONE);
    CUmemGenericAllocationHandle h, r;
    CUdeviceptr keep, va;
    must(FN(cuMemAlloc_v2)(&keep, CHUNK / 2), "alloc");
    unsigned long long base = mem_free();
    /* One handle mapped twice side by side, released, one unmap for both. */
    must(FN(cuMemCreate)(&h, CHUNK, &prop, 0), "create");
    must(FN(cuMemAddressReserve)(&va, 2 * CHUNK, 0, 0, 0), "reserve");
    must(FN(cuMemMap)(va, CHUNK, 0, h, 0), "map 1");
    must(FN(cuMemMap)(va + CHUNK, CHUNK, 0, h, 0), "map 2");
    must(FN(cuMemRelease)(h), "release");
    unsigned long long twice = mem_free();
    must(FN(cuMemUnmap)(va, 2 * CHUNK), "unmap both");
    unsigned long long unmapped_both = mem_free();
    /* Released twice while mapped: given back once, whatever the driver says to the second. */
    must(FN(cuMemCreate)(&h, CHUNK, &prop, 0), "create");
    must(FN(cuMemMap)(va, CHUNK, 0, h, 0), "map");
    must(FN(cuMemRelease)(h), "release");
    CUresult again = FN(cuMemRelease)(h);
    unsigned long long released_twice = mem_free();
    must(FN(cuMemUnmap)(va, CHUNK), "unmap");
    unsigned long long unmapped_once = mem_free();
    /* Released, retained through the mapping, unmapped: the retained
     * handle holds the memory until it is released too. */
    must(FN(cuMemCreate)(&h, CHUNK, &prop, 0), "create");
    must(FN(cuMemMap)(va, CHUNK, 0, h, 0), "map");
    must(FN(cuMemRelease)(h), "release");
    must(FN(cuMemRetainAllocationHandle)(&r, (void *)(uintptr_t)va), "retain");
    must(FN(cuMemUnmap)(va, CHUNK), "unmap");
    unsigned long long retained = mem_free();
    must(FN(cuMemMap)(va, CHUNK, 0, r, 0), "map retained");
    must(FN(cuMemRelease)(r), "release retained");
    unsigned long long remapped = mem_free();
    must(FN(cuMemUnmap)(va, CHUNK), "unmap retained");
    unsigned long long all_gone = mem_free();
    /* Many cycles: nothing left over. */
    for (int i = 0; i < 1000; i++) {
        must(FN(cuMemCreate)(&h, CHUNK, &prop, 0), "create");
        must(FN(cuMemMap)(va, CHUNK, 0, h, 0), "map");
        must(FN(cuMemRelease)(h), "release");
        must(FN(cuMemUnmap)(va, CHUNK), "unmap");
    }
    unsigned long long cycled = mem_free();
    FN(cuMemAddressFree)(va, 2 * CHUNK);
    printf("{\"base\":%llu,\"twice\":%llu,\"unmapped_both\":%llu,\"release_again\":\"%s\",\"released_twice\":%llu,"
           "\"unmapped_once\":%llu,\"retained\":%llu,\"remapped\":%llu,\"all_gone\":%llu,\"cycled\":%llu}\n",
           base, twice, unmapped_both, err(again), released_twice, unmapped_once, retained, remapped, all_gone,
           cycled);
    must(FN(cuMemFree_v2)(keep), "free");
    return 0;
}

static int export_then_exec(const char *self)
{
    CUmemAllocationProp prop = device_prop(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h;
    int fd = -1;
    must(FN(cuMemCreate)(&h, CHUNK, &prop, 0), "create");
    must(FN(cuMemExportToShareableHandle)(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export");
    must(FN(cuMemRelease)(h), "release");
    printf("{\"phase\":1,\"exporter_free\":%llu}\n", mem_free());
    fflush(stdout);
    /* The importer learns that we are gone when the pipe's write end,
     * ours alone, closes. */
    int gone[2];
    if (pipe(gone) != 0)
        return 5;
    fcntl(fd, F_SETFD, 0);
    fcntl(gone[0], F_SETFD, 0);
    pid_t child = fork();
    if (child == 0) {
        char arg[16], arg2[16];
        close(gone[1]);
        snprintf(arg, sizeof(arg), "%d", fd);
        snprintf(arg2, sizeof(arg2), "%d", gone[0]);
        execl(self, self, "import", arg, arg2, (char *)NULL);
        _exit(127);
    }
    return child > 0 ? 0 : 5; /* exits now */
}

static int import(int fd, int exporter_gone)
{
    char c;
    while (read(exporter_gone, &c, 1) > 0)
        ;
    init();
    CUmemGenericAllocationHandle h;
    CUresult rc = FN(cuMemImportFromShareableHandle)(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    unsigned long long f = mem_free();
    CUdeviceptr p;
    CUresult big = FN(cuMemAlloc_v2)(&p, 768 * MIB);
    printf("{\"phase\":2,\"import\":\"%s\",\"importer_free\":%llu,\"alloc_768\":\"%s\"}\n", err(rc), f, err(big));
    return 0;
}

static int graph(void)
{
    CUgraph g;
    must(FN(cuGraphCreate)(&g, 0), "graph");
    CUgraphNodeParams p;
    memset(&p, 0, sizeof(p));
    p.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
    p.alloc.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.alloc.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.alloc.bytesize = 2048 * MIB;
    CUgraphNode n1, n2;
    CUresult v1 = FN(cuGraphAddNode)(&n1, g, NULL, 0, &p);
    __typeof__(&cuGetProcAddress_v2) gpa = FN(cuGetProcAddress_v2);
    void *fn = NULL;
    must(gpa("cuGraphAddNode", &fn, 13000, 0, NULL), "cuGetProcAddress_v2");
    CUresult v2 = ((__typeof__(&cuGraphAddNode_v2))fn)(&n2, g, NULL, NULL, 0, &p);
    CUgraphExec x;
    CUresult inst = FN(cuGraphInstantiateWithFlags)(&x, g, 0);
    printf("{\"add_node\":\"%s\",\"add_node_v2\":\"%s\",\"instantiate\":\"%s\",\"free\":%llu}\n", err(v1), err(v2),
           err(inst), mem_free());
    if (inst == CUDA_SUCCESS)
        FN(cuGraphExecDestroy)(x);
    FN(cuGraphDestroy)(g);
    return 0;
}

static int limits(void)
{
    __typeof__(&cuCtxSetLimit) set = FN(cuCtxSetLimit);
    CUresult heap = set(CU_LIMIT_MALLOC_HEAP_SIZE, 8 * MIB + 768 * MIB);
    unsigned long long after_heap = mem_free();
    CUresult stack = set(CU_LIMIT_STACK_SIZE, 4096); /* 3 KiB more for each of 270336 threads */
    unsigned long long after_stack = mem_free();
    CUresult shrink = set(CU_LIMIT_MALLOC_HEAP_SIZE, 8 * MIB);
    unsigned long long after_shrink = mem_free();
    CUresult stack2 = set(CU_LIMIT_STACK_SIZE, 2048);
    printf("{\"heap\":\"%s\",\"free_heap\":%llu,\"stack_4k\":\"%s\",\"free_stack_4k\":%llu,\"shrink\":\"%s\","
           "\"free_shrink\":%llu,\"stack_2k\":\"%s\",\"free_stack_2k\":%llu}\n",
           err(heap), after_heap, err(stack), after_stack, err(shrink), after_shrink, err(stack2), mem_free());
    return 0;
}

/* What a runtime built for CUDA 3.0 gets for these names. */
static void *old(const char *name, int v2)
{
    void *fn = NULL;
    CUresult rc = v2 ? FN(cuGetProcAddress_v2)(name, &fn, 3000, 0, NULL) : FN(cuGetProcAddress)(name, &fn, 3000, 0);
    must(rc, name);
    return fn;
}

static int oldabi(void)
{
    __typeof__(&cuMemAlloc) alloc = old("cuMemAlloc", 1);
    __typeof__(&cuMemFree) mfree = old("cuMemFree", 0);
    __typeof__(&cuMemGetInfo) info = old("cuMemGetInfo", 1);
    __typeof__(&cuDeviceTotalMem) total_mem = old("cuDeviceTotalMem", 0);
    __typeof__(&cuMemAllocPitch) pitch = old("cuMemAllocPitch", 1);
    __typeof__(&cuArrayCreate) array = old("cuArrayCreate", 0);
    CUdeviceptr_v1 p[3] = {0};
    CUresult rc[3];
    for (int i = 0; i < 3; i++)
        rc[i] = alloc(&p[i], (unsigned)CHUNK);
    unsigned f = 0, t = 0, total = 0;
    must(info(&f, &t), "cuMemGetInfo v1");
    must(total_mem(&total, 0), "cuDeviceTotalMem v1");
    CUdeviceptr_v1 pp;
    unsigned pitch_bytes;
    CUresult prc = pitch(&pp, &pitch_bytes, 4096, 1024, 4);
    CUDA_ARRAY_DESCRIPTOR_v1 d = {8192, 8192, CU_AD_FORMAT_FLOAT, 4}; /* 1 GiB */
    CUarray a;
    CUresult arc = array(&a, &d);
    must(mfree(p[0]), "cuMemFree v1");
    unsigned f2 = 0, t2 = 0;
    must(info(&f2, &t2), "cuMemGetInfo v1");
    printf("{\"allocs\":[\"%s\",\"%s\",\"%s\"],\"free\":%u,\"total\":%u,\"device_total\":%u,\"pitch\":\"%s\","
           "\"array\":\"%s\",\"free_after_free\":%u}\n",
           err(rc[0]), err(rc[1]), err(rc[2]), f, t, total, err(prc), err(arc), f2);
    for (int i = 1; i < 3; i++)
        if (rc[i] == CUDA_SUCCESS)
            mfree(p[i]);
    if (prc == CUDA_SUCCESS)
        mfree(pp);
    if (arc == CUDA_SUCCESS)
        FN(cuArrayDestroy)(a);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    driver_open();
    if (strcmp(argv[1], "import") == 0 && argc == 4)
        return import(atoi(argv[2]), atoi(argv[3]));
    if (strcmp(argv[1], "export") == 0) {
        init();
        return export_then_exec(argv[0]);
    }
    init();
    if (strcmp(argv[1], "vmm") == 0)
        return vmm();
    if (strcmp(argv[1], "retain") == 0)
        return retain();
    if (strcmp(argv[1], "vmm-orders") == 0)
        return vmm_orders();
    if (strcmp(argv[1], "graph") == 0)
        return graph();
    if (strcmp(argv[1], "limits") == 0)
        return limits();
    if (strcmp(argv[1], "oldabi") == 0)
        return oldabi();
    return 2;
}
