/* libcgpu.so: device memory. Every allocation is charged to the instance
 * with one atomic check-and-add before the driver is asked, rolled back if
 * the driver fails, and given back exactly once when freed. */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../region/region.h"
#include "libcgpu.h"

/* ---- which instance device ------------------------------------------------------ */

#define MAX_ORDINALS 64
/* CUDA ordinal -> instance device + 2: 1 is "outside the instance", 0 "not
 * looked up yet", as static storage starts. CUDA_VISIBLE_DEVICES reorders
 * ordinals, so identity is the UUID, looked up once per ordinal. */
static _Atomic int slot_of_ordinal[MAX_ORDINALS];

static int slot_of_uuid(const char *uuid)
{
    for (unsigned i = 0; i < g_cgpu.device_count; i++) {
        if (strcasecmp(g_cgpu.device[i].uuid, uuid) == 0)
            return (int)i;
    }
    return -1;
}

static void format_uuid(const CUuuid *u, char *out, size_t len)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

int cgpu_slot_of_cuda_device(CUdevice dev)
{
    if (dev < 0 || dev >= MAX_ORDINALS)
        return -1;
    int cached = atomic_load_explicit(&slot_of_ordinal[dev], memory_order_relaxed);
    if (cached)
        return cached - 2;
    CUuuid uuid;
    __typeof__(&cuDeviceGetUuid_v2) get_uuid = REAL(cuDeviceGetUuid_v2);
    if (!get_uuid)
        return -1;
    if (get_uuid(&uuid, dev) != CUDA_SUCCESS)
        return -1; /* not cached: the driver may not be initialised yet */
    char text[CGPU_UUID_LEN];
    format_uuid(&uuid, text, sizeof(text));
    int slot = slot_of_uuid(text);
    atomic_store_explicit(&slot_of_ordinal[dev], slot + 2, memory_order_relaxed);
    return slot;
}

int cgpu_slot_of_nvml_device(nvmlDevice_t dev)
{
    char uuid[CGPU_UUID_LEN];
    __typeof__(&nvmlDeviceGetUUID) get_uuid = REAL(nvmlDeviceGetUUID);
    if (!get_uuid || get_uuid(dev, uuid, sizeof(uuid)) != NVML_SUCCESS)
        return -1;
    return slot_of_uuid(uuid);
}

static int current_slot(void)
{
    CUdevice dev;
    __typeof__(&cuCtxGetDevice) get_dev = REAL(cuCtxGetDevice);
    if (!get_dev || get_dev(&dev) != CUDA_SUCCESS)
        return -2; /* no context: let the driver report it */
    return cgpu_slot_of_cuda_device(dev);
}

uint64_t cgpu_slot_used(int slot)
{
    return atomic_load_explicit(&g_cgpu.usage->device[slot].used, memory_order_relaxed);
}

bool cgpu_pid_in_instance(unsigned int pid)
{
    for (int i = 0, n = cgpu_ledger_count(g_cgpu.usage); i < n; i++) {
        const struct cgpu_proc_ledger *p = &g_cgpu.usage->proc[i];
        if (atomic_load(&p->state) == CGPU_LEDGER_LIVE && (unsigned int)atomic_load(&p->pid) == pid)
            return true;
    }
    return false;
}

/* ---- charging ----------------------------------------------------------------------- */

static int my_ledger(void)
{
    int ledger = g_cgpu.ledger;
    if (CGPU_UNLIKELY(ledger < 0)) { /* first allocation after fork */
        pthread_mutex_lock(&g_cgpu.ledger_lock);
        cgpu_claim_ledger_locked();
        ledger = g_cgpu.ledger;
        pthread_mutex_unlock(&g_cgpu.ledger_lock);
    }
    return ledger;
}

/* Memory of processes that died is the instance's again. Not on the hot
 * path: before refusing an allocation and before reporting free memory. */
int cgpu_reap_dead(void)
{
    pthread_mutex_lock(&g_cgpu.ledger_lock);
    int reaped = g_cgpu.usage_fd >= 0 ? cgpu_ledger_reap(g_cgpu.usage, g_cgpu.usage_fd, g_cgpu.ledger) : 0;
    pthread_mutex_unlock(&g_cgpu.ledger_lock);
    return reaped;
}

static bool charge(int slot, uint64_t bytes)
{
    uint64_t limit = g_cgpu.device[slot].mem_limit;
    int ledger = my_ledger();
    if (ledger < 0)
        return false;
    if (cgpu_ledger_charge(g_cgpu.usage, ledger, (unsigned)slot, limit, bytes))
        return true;
    if (cgpu_reap_dead() && cgpu_ledger_charge(g_cgpu.usage, ledger, (unsigned)slot, limit, bytes))
        return true;
    cgpu_log(CGPU_LOG_DEBUG, "out of memory: %llu bytes asked, %llu of %llu in use on %s", (unsigned long long)bytes,
             (unsigned long long)cgpu_slot_used(slot), (unsigned long long)limit, g_cgpu.device[slot].uuid);
    return false;
}

static void uncharge(int slot, uint64_t bytes)
{
    cgpu_ledger_uncharge(g_cgpu.usage, g_cgpu.ledger, (unsigned)slot, bytes);
}

/* ---- what each allocation holds ------------------------------------------------- */

/* Lock-free open addressing, made and pre-faulted at the first allocation,
 * never grown: no allocation, lock or page fault on the allocation paths
 * after that. 128 Ki live allocations (3 MiB); past that an allocation's
 * bytes stay charged (the safe side) and the library says so. */
#define TABLE_SIZE (1u << 17)
#define KEY_EMPTY 0ULL
#define KEY_TOMB 1ULL

enum alloc_kind { KIND_POINTER = 1, KIND_HANDLE = 2, KIND_ARRAY = 3 };

struct alloc_entry {
    _Atomic uint64_t key;
    uint64_t bytes;
    int slot;
    int pad;
};

static struct alloc_entry *_Atomic table;

static struct alloc_entry *get_table(void)
{
    struct alloc_entry *t = atomic_load_explicit(&table, memory_order_acquire);
    if (CGPU_UNLIKELY(!t)) {
        void *m = mmap(NULL, TABLE_SIZE * sizeof(*t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                       -1, 0);
        if (m == MAP_FAILED)
            return NULL;
        struct alloc_entry *expect = NULL;
        if (!atomic_compare_exchange_strong(&table, &expect, m)) {
            munmap(m, TABLE_SIZE * sizeof(*t));
            return expect;
        }
        t = m;
    }
    return t;
}

static uint64_t make_key(enum alloc_kind kind, uint64_t value)
{
    return (value ^ ((uint64_t)kind << 61)) | 2; /* never EMPTY or TOMB */
}

static size_t home(uint64_t key)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> 47) & (TABLE_SIZE - 1);
}

static bool remember(enum alloc_kind kind, uint64_t value, uint64_t bytes, int slot)
{
    struct alloc_entry *t = get_table();
    if (!t)
        return false;
    uint64_t key = make_key(kind, value);
    for (size_t n = 0, i = home(key); n < TABLE_SIZE; n++, i = (i + 1) & (TABLE_SIZE - 1)) {
        uint64_t cur = atomic_load_explicit(&t[i].key, memory_order_relaxed);
        if (cur != KEY_EMPTY && cur != KEY_TOMB)
            continue;
        /* Fill first, then publish the key: a reader who finds the key
         * finds the size with it. */
        if (atomic_compare_exchange_strong(&t[i].key, &cur, KEY_TOMB)) {
            t[i].bytes = bytes;
            t[i].slot = slot;
            atomic_store_explicit(&t[i].key, key, memory_order_release);
            return true;
        }
    }
    return false;
}

/* Takes the record out; exactly one caller gets it. */
static bool forget(enum alloc_kind kind, uint64_t value, uint64_t *bytes, int *slot)
{
    struct alloc_entry *t = atomic_load_explicit(&table, memory_order_acquire);
    if (!t)
        return false;
    uint64_t key = make_key(kind, value);
    for (size_t n = 0, i = home(key); n < TABLE_SIZE; n++, i = (i + 1) & (TABLE_SIZE - 1)) {
        uint64_t cur = atomic_load_explicit(&t[i].key, memory_order_acquire);
        if (cur == KEY_EMPTY)
            return false;
        if (cur != key)
            continue;
        *bytes = t[i].bytes;
        *slot = t[i].slot;
        if (atomic_compare_exchange_strong(&t[i].key, &cur, KEY_TOMB))
            return true;
    }
    return false;
}

/* ---- the hooks ------------------------------------------------------------------------ */

enum route { ROUTE_FORWARD, ROUTE_REFUSE, ROUTE_CHARGE };

/* What to do with an allocation on instance device `slot` (or the error
 * current_slot() gave): forward untouched, refuse, or charge. */
static enum route route_to(int slot)
{
    switch (cgpu_state()) {
    case CGPU_PASSTHROUGH: return ROUTE_FORWARD;
    case CGPU_BROKEN: return ROUTE_REFUSE; /* fail closed */
    default: break;
    }
    if (slot == -2)
        return ROUTE_FORWARD; /* no context: the driver's error to give */
    return slot >= 0 ? ROUTE_CHARGE : ROUTE_REFUSE; /* a GPU outside the instance */
}

static enum route route_current(int *slot)
{
    if (cgpu_state() != CGPU_ACTIVE)
        return route_to(-1);
    *slot = current_slot();
    return route_to(*slot);
}

/* Calls the driver, or reports it missing instead of calling NULL. */
#define CALL_REAL(symbol, ...)                                                                  \
    ({                                                                                          \
        __typeof__(&symbol) real_ = REAL(symbol);                                               \
        real_ ? real_(__VA_ARGS__) : CUDA_ERROR_NOT_INITIALIZED;                                \
    })

#define ROUTE_OR_RETURN(route, symbol, ...)                                                     \
    switch (route) {                                                                            \
    case ROUTE_FORWARD: return CALL_REAL(symbol, __VA_ARGS__);                                  \
    case ROUTE_REFUSE: return CUDA_ERROR_OUT_OF_MEMORY;                                         \
    case ROUTE_CHARGE: break;                                                                   \
    }

/* Charge, call the driver, then remember what the result holds or roll back. */
#define CHARGED_CALL(kind, slot, bytes, key, symbol, ...)                                       \
    do {                                                                                        \
        if (!charge(slot, bytes))                                                               \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                    \
        CUresult rc_ = CALL_REAL(symbol, __VA_ARGS__);                                          \
        if (rc_ != CUDA_SUCCESS) {                                                              \
            uncharge(slot, bytes);                                                              \
            return rc_;                                                                         \
        }                                                                                       \
        if (!remember(kind, (uint64_t)(key), bytes, slot))                                      \
            cgpu_log(CGPU_LOG_ERROR, "allocation table full: %llu bytes stay charged",          \
                     (unsigned long long)(bytes));                                              \
        return CUDA_SUCCESS;                                                                    \
    } while (0)

/* Gives back what the freed object held, exactly once; if the driver
 * refuses the free, the record goes back. */
#define RELEASING_CALL(kind, value, symbol, ...)                                                \
    do {                                                                                        \
        uint64_t bytes_;                                                                        \
        int slot_;                                                                              \
        bool held_ = cgpu_state() == CGPU_ACTIVE && forget(kind, (uint64_t)(value), &bytes_, &slot_); \
        CUresult rc_ = CALL_REAL(symbol, __VA_ARGS__);                                          \
        if (held_ && rc_ == CUDA_SUCCESS)                                                       \
            uncharge(slot_, bytes_);                                                            \
        else if (held_)                                                                         \
            remember(kind, (uint64_t)(value), bytes_, slot_);                                   \
        return rc_;                                                                             \
    } while (0)

CGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    int slot = -1;
    ROUTE_OR_RETURN(dptr && bytesize ? route_current(&slot) : ROUTE_FORWARD, cuMemAlloc_v2, dptr, bytesize);
    CHARGED_CALL(KIND_POINTER, slot, bytesize, *dptr, cuMemAlloc_v2, dptr, bytesize);
}

CGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    int slot = -1;
    /* Counted in full against the current GPU: managed memory can all
     * become resident there. */
    ROUTE_OR_RETURN(dptr && bytesize ? route_current(&slot) : ROUTE_FORWARD, cuMemAllocManaged, dptr, bytesize,
                    flags);
    CHARGED_CALL(KIND_POINTER, slot, bytesize, *dptr, cuMemAllocManaged, dptr, bytesize, flags);
}

CGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    int slot = -1;
    ROUTE_OR_RETURN(dptr && bytesize ? route_current(&slot) : ROUTE_FORWARD, cuMemAllocAsync, dptr, bytesize,
                    hStream);
    CHARGED_CALL(KIND_POINTER, slot, bytesize, *dptr, cuMemAllocAsync, dptr, bytesize, hStream);
}

CGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    int slot = -1;
    ROUTE_OR_RETURN(dptr && bytesize ? route_current(&slot) : ROUTE_FORWARD, cuMemAllocAsync_ptsz, dptr,
                    bytesize, hStream);
    CHARGED_CALL(KIND_POINTER, slot, bytesize, *dptr, cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
}

CGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    int slot = -1;
    ROUTE_OR_RETURN(dptr && bytesize ? route_current(&slot) : ROUTE_FORWARD, cuMemAllocFromPoolAsync, dptr,
                    bytesize, pool, hStream);
    CHARGED_CALL(KIND_POINTER, slot, bytesize, *dptr, cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}

CGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream hStream)
{
    int slot = -1;
    ROUTE_OR_RETURN(dptr && bytesize ? route_current(&slot) : ROUTE_FORWARD, cuMemAllocFromPoolAsync_ptsz, dptr,
                    bytesize, pool, hStream);
    CHARGED_CALL(KIND_POINTER, slot, bytesize, *dptr, cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
}

/* The pitch is the driver's choice: charge a row rounded to 512 bytes (the
 * usual texture pitch alignment), then settle on the real pitch x height. */
CGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                        unsigned int ElementSizeBytes)
{
    int slot = -1;
    uint64_t row = ((uint64_t)WidthInBytes + 511) & ~511ULL;
    bool sane = dptr && pPitch && WidthInBytes && Height && row >= WidthInBytes && Height <= UINT64_MAX / row;
    ROUTE_OR_RETURN(sane ? route_current(&slot) : ROUTE_FORWARD, cuMemAllocPitch_v2, dptr, pPitch, WidthInBytes,
                    Height, ElementSizeBytes);
    uint64_t guess = row * Height;
    if (!charge(slot, guess))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL_REAL(cuMemAllocPitch_v2, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        uncharge(slot, guess);
        return rc;
    }
    uint64_t real = (uint64_t)*pPitch * Height;
    if (real > guess && !charge(slot, real - guess)) {
        CALL_REAL(cuMemFree_v2, *dptr);
        uncharge(slot, guess);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (real < guess)
        uncharge(slot, guess - real);
    if (!remember(KIND_POINTER, *dptr, real, slot))
        cgpu_log(CGPU_LOG_ERROR, "allocation table full: %llu bytes stay charged", (unsigned long long)real);
    return CUDA_SUCCESS;
}

CGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    /* Host locations (NCCL's host buffers) are not device memory. */
    bool device = handle && size && prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
    int slot = device && cgpu_state() == CGPU_ACTIVE ? cgpu_slot_of_cuda_device(prop->location.id) : -1;
    ROUTE_OR_RETURN(device ? route_to(slot) : ROUTE_FORWARD, cuMemCreate, handle, size, prop, flags);
    CHARGED_CALL(KIND_HANDLE, slot, size, *handle, cuMemCreate, handle, size, prop, flags);
}

static uint64_t format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 8; /* wider formats: count generously */
    }
}

/* Bytes of a W x H x D array level; 0 (forward, the driver rejects it)
 * when the description cannot be sized. */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned channels)
{
    uint64_t elem = format_bytes(f) * (channels ? channels : 1);
    uint64_t n = w;
    for (uint64_t dim = h ? h : 1, k = 0; k < 2; k++, dim = d ? d : 1) {
        if (n > UINT64_MAX / dim)
            return 0;
        n *= dim;
    }
    return n > UINT64_MAX / elem ? 0 : n * elem;
}

static CUresult call_array_create(enum cgpu_hook_id id, void **out, const void *desc, unsigned levels)
{
    switch (id) {
    case HOOK_cuArrayCreate_v2: return CALL_REAL(cuArrayCreate_v2, (CUarray *)out, desc);
    case HOOK_cuArray3DCreate_v2: return CALL_REAL(cuArray3DCreate_v2, (CUarray *)out, desc);
    default: return CALL_REAL(cuMipmappedArrayCreate, (CUmipmappedArray *)out, desc, levels);
    }
}

static CUresult create_array(void **out, uint64_t bytes, enum cgpu_hook_id id, const void *desc, unsigned levels)
{
    int slot = -1;
    switch (out && desc && bytes ? route_current(&slot) : ROUTE_FORWARD) {
    case ROUTE_FORWARD: return call_array_create(id, out, desc, levels);
    case ROUTE_REFUSE: return CUDA_ERROR_OUT_OF_MEMORY;
    case ROUTE_CHARGE: break;
    }
    if (!charge(slot, bytes))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = call_array_create(id, out, desc, levels);
    if (rc != CUDA_SUCCESS)
        uncharge(slot, bytes);
    else if (!remember(KIND_ARRAY, (uint64_t)(uintptr_t)*out, bytes, slot))
        cgpu_log(CGPU_LOG_ERROR, "allocation table full: %llu bytes stay charged", (unsigned long long)bytes);
    return rc;
}

CGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    uint64_t bytes = d ? array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels) : 0;
    return create_array((void **)pHandle, bytes, HOOK_cuArrayCreate_v2, d, 0);
}

CGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    uint64_t bytes = d ? array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels) : 0;
    return create_array((void **)pHandle, bytes, HOOK_cuArray3DCreate_v2, d, 0);
}

CGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                            unsigned int numMipmapLevels)
{
    uint64_t total = 0;
    if (d && numMipmapLevels <= 32) {
        uint64_t w = d->Width, h = d->Height, z = d->Depth;
        for (unsigned l = 0; l < numMipmapLevels; l++) {
            uint64_t level = array_bytes(w, h, z, d->Format, d->NumChannels);
            total = level && total <= UINT64_MAX - level ? total + level : 0;
            w = w > 1 ? w / 2 : 1;
            h = h > 1 ? h / 2 : h;
            z = z > 1 ? z / 2 : z;
        }
    }
    return create_array((void **)pHandle, total, HOOK_cuMipmappedArrayCreate, d, numMipmapLevels);
}

/* Graph memory nodes allocate when the graph runs and free when a free node
 * or a trim says so: no moment to charge them exactly. Under a limit they
 * are refused, as cGPU refuses what it cannot account; a runtime falls back
 * to ordinary allocations. */
CGPU_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                            size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    if (cgpu_state() != CGPU_PASSTHROUGH) {
        cgpu_log(CGPU_LOG_INFO, "graph memory nodes are not supported under a memory limit");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return CALL_REAL(cuGraphAddMemAllocNode, phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

CGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    RELEASING_CALL(KIND_POINTER, dptr, cuMemFree_v2, dptr);
}

CGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    RELEASING_CALL(KIND_POINTER, dptr, cuMemFreeAsync, dptr, hStream);
}

CGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    RELEASING_CALL(KIND_POINTER, dptr, cuMemFreeAsync_ptsz, dptr, hStream);
}

CGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    RELEASING_CALL(KIND_HANDLE, handle, cuMemRelease, handle);
}

CGPU_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    RELEASING_CALL(KIND_ARRAY, (uintptr_t)hArray, cuArrayDestroy, hArray);
}

CGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    RELEASING_CALL(KIND_ARRAY, (uintptr_t)hMipmappedArray, cuMipmappedArrayDestroy, hMipmappedArray);
}

/* ---- memory as the instance sees it ------------------------------------------------ */

CGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    /* The driver first: it validates the arguments and the context. */
    CUresult rc = CALL_REAL(cuMemGetInfo_v2, free_bytes, total);
    if (rc != CUDA_SUCCESS || cgpu_state() != CGPU_ACTIVE)
        return rc;
    cgpu_reap_dead();
    int slot = current_slot();
    uint64_t limit = slot >= 0 ? g_cgpu.device[slot].mem_limit : 0;
    uint64_t used = slot >= 0 ? cgpu_slot_used(slot) : 0;
    uint64_t left = used < limit ? limit - used : 0;
    /* Never more than the GPU really has free: other tenants may hold it. */
    if (left > *free_bytes)
        left = *free_bytes;
    *total = (size_t)limit;
    *free_bytes = (size_t)left;
    return rc;
}

CGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult rc = CALL_REAL(cuDeviceTotalMem_v2, bytes, dev);
    if (rc != CUDA_SUCCESS || cgpu_state() != CGPU_ACTIVE)
        return rc;
    int slot = cgpu_slot_of_cuda_device(dev);
    *bytes = slot >= 0 ? (size_t)g_cgpu.device[slot].mem_limit : 0;
    return rc;
}
