/* libcgpu.so: device memory. Every allocation is charged to the instance
 * with one atomic check-and-add before the driver is asked, rolled back if
 * the driver fails, and given back exactly once when the memory is really
 * gone: at the free, or for VMM memory when its handle is released and its
 * last mapping unmapped, whichever comes last. */
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../region/region_charge.h"
#include "../region/region_ops.h"
#include "cgpu/array_format.h"
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
    snprintf(out, len, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
             b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The instance device whose UUID has these 16 bytes. A region names a GPU
 * "GPU-..." and a MIG device "MIG-..."; the driver's bytes say neither:
 * cuDeviceGetUuid_v2 gives a MIG device's own UUID, and UUIDs are unique
 * across GPUs and MIG devices. */
static int slot_of_uuid_hex(const char *hex)
{
    for (unsigned i = 0; i < g_cgpu.device_count; i++) {
        const char *u = g_cgpu.device[i].uuid;
        if ((strncmp(u, "GPU-", 4) == 0 || strncmp(u, "MIG-", 4) == 0) && strcasecmp(u + 4, hex) == 0)
            return (int)i;
    }
    return -1;
}

/* The first look-up of an ordinal (or one the driver could not answer). */
static __attribute__((noinline)) int slot_of_cuda_device_slow(CUdevice dev)
{
    CUuuid uuid;
    __typeof__(&cuDeviceGetUuid_v2) get_uuid = REAL(cuDeviceGetUuid_v2);
    if (!get_uuid)
        return -1;
    if (get_uuid(&uuid, dev) != CUDA_SUCCESS)
        return -1; /* not cached: the driver may not be initialised yet */
    char text[CGPU_UUID_LEN];
    format_uuid(&uuid, text, sizeof(text));
    int slot = slot_of_uuid_hex(text);
    atomic_store_explicit(&slot_of_ordinal[dev], slot + 2, memory_order_relaxed);
    return slot;
}

int cgpu_slot_of_cuda_device(CUdevice dev)
{
    if (dev < 0 || dev >= MAX_ORDINALS)
        return -1;
    int cached = atomic_load_explicit(&slot_of_ordinal[dev], memory_order_relaxed);
    return CGPU_LIKELY(cached) ? cached - 2 : slot_of_cuda_device_slow(dev);
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

/* Charged under `limit`; kept unless a shrink lowered the live limit under
 * the instance's usage meanwhile (region_ops.h: cgpu_grants_store_mem_limit). */
static __attribute__((noinline, cold)) bool kept_after_shrink(int slot, int ledger, uint64_t limit, uint64_t bytes)
{
    if (!cgpu_usage_over_live(g_cgpu.usage, (unsigned)slot, g_cgpu.device[slot].mem_limit, limit))
        return true;
    cgpu_ledger_uncharge(g_cgpu.usage, ledger, (unsigned)slot, bytes);
    return false;
}

static inline bool kept_live(const _Atomic uint64_t *live, int slot, int ledger, uint64_t limit, uint64_t bytes)
{
    /* seq_cst, after the seq_cst reserve: the charger's half of the protocol */
    if (CGPU_LIKELY(atomic_load_explicit(live, memory_order_seq_cst) >= limit))
        return true;
    return kept_after_shrink(slot, ledger, limit, bytes);
}

static inline bool kept(int slot, int ledger, uint64_t limit, uint64_t bytes)
{
    return kept_live(g_cgpu.device[slot].mem_limit, slot, ledger, limit, bytes);
}

/* Everything but a first try that fits: no ledger yet (after fork), memory
 * of dead processes to reap, out of memory. */
static __attribute__((noinline, cold)) bool charge_slow(int slot, uint64_t bytes)
{
    uint64_t limit = cgpu_mem_limit(slot);
    int ledger = my_ledger();
    if (ledger < 0)
        return false;
    if (cgpu_ledger_charge(g_cgpu.usage, ledger, (unsigned)slot, limit, bytes))
        return kept(slot, ledger, limit, bytes);
    if (cgpu_reap_dead() && cgpu_ledger_charge(g_cgpu.usage, ledger, (unsigned)slot, limit, bytes))
        return kept(slot, ledger, limit, bytes);
    cgpu_log(CGPU_LOG_DEBUG, "out of memory: %llu bytes asked, %llu of %llu in use on %s", (unsigned long long)bytes,
             (unsigned long long)cgpu_slot_used(slot), (unsigned long long)limit, g_cgpu.device[slot].uuid);
    return false;
}

/* The steps of cgpu_ledger_charge and the live-limit check inline: a first
 * try that fits makes no call. `slot` is an instance device, and a claimed
 * ledger is in range. */
static inline bool charge(int slot, uint64_t bytes)
{
    const _Atomic uint64_t *live = g_cgpu.device[slot].mem_limit;
    uint64_t limit = atomic_load_explicit(live, memory_order_relaxed);
    int ledger = g_cgpu.ledger;
    if (CGPU_LIKELY(ledger >= 0) &&
        CGPU_LIKELY(cgpu_ledger_charge_at(g_cgpu.usage, ledger, (unsigned)slot, limit, bytes)))
        return kept_live(live, slot, ledger, limit, bytes);
    return charge_slow(slot, bytes);
}

/* `slot` is always an instance device (a route's or a record's); the
 * ledger is -1 in a child that has not claimed its own yet. */
static inline void uncharge(int slot, uint64_t bytes)
{
    int ledger = g_cgpu.ledger;
    if (CGPU_LIKELY(ledger >= 0))
        cgpu_ledger_uncharge_at(g_cgpu.usage, ledger, (unsigned)slot, bytes);
    else
        cgpu_ledger_uncharge_inline(g_cgpu.usage, ledger, (unsigned)slot, bytes);
}

/* ---- what each allocation holds ------------------------------------------------- */

/* Lock-free open addressing, made and pre-faulted at the first allocation,
 * never grown: no allocation, lock or page fault on the allocation paths
 * after that. 128 Ki live records (5 MiB); past that an allocation's
 * bytes stay charged (the safe side) and the library says so. */
#define TABLE_SIZE (1u << 17)
#define KEY_EMPTY 0ULL
#define KEY_TOMB 1ULL

/* VMM memory has two kinds of record. HANDLE: the physical memory behind an
 * application's handle (its value, bytes and slot), with aux the handle's
 * references (cuMemCreate or import, then one per retain; under vmm_lock)
 * and refs what keeps the memory alive (1 while aux > 0, one per mapping,
 * EXPORT_PIN). Once its last handle reference is released the record is
 * detached: re-keyed in place to a key nobody looks up (the driver may give
 * the handle value to a new allocation), still named by its mappings.
 * MAPPING: a mapped VA, its size, and in aux the address of its HANDLE
 * record (0: memory we do not track). Records never move (the table is
 * never grown), so a mapping can name its memory by address: no third
 * record, no look-up by a serial of ours. LIMIT: a context's stack/heap charge. */
enum alloc_kind { KIND_POINTER = 1, KIND_HANDLE = 2, KIND_ARRAY = 3, KIND_DETACHED = 4, KIND_MAPPING = 5, KIND_LIMIT = 6 };

struct alloc_entry {
    _Atomic uint64_t key;
    uint64_t value; /* the full pointer or handle: keys of two values can collide */
    uint64_t bytes;
    uint64_t aux;
    int slot;
    _Atomic int refs; /* HANDLE/DETACHED only */
};

static struct alloc_entry *_Atomic table;

/* Out of line, so that the allocation path saves no registers for it. */
static __attribute__((noinline, cold)) struct alloc_entry *make_table(void)
{
    void *m = mmap(NULL, TABLE_SIZE * sizeof(struct alloc_entry), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    struct alloc_entry *expect = NULL;
    if (!atomic_compare_exchange_strong(&table, &expect, m)) {
        munmap(m, TABLE_SIZE * sizeof(struct alloc_entry));
        return expect;
    }
    return m;
}

static uint64_t make_key(enum alloc_kind kind, uint64_t value)
{
    return (value ^ ((uint64_t)kind << 61)) | 2; /* never EMPTY or TOMB */
}

static size_t home(uint64_t key)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> 47) & (TABLE_SIZE - 1);
}

static bool remember_aux(enum alloc_kind kind, uint64_t value, uint64_t bytes, int slot, uint64_t aux);

/* The first record makes the table; a tail call, so that remember_aux
 * saves no registers for it. */
static __attribute__((noinline, cold)) bool remember_first(enum alloc_kind kind, uint64_t value, uint64_t bytes,
                                                           int slot, uint64_t aux)
{
    return make_table() && remember_aux(kind, value, bytes, slot, aux);
}

/* remember_aux's steps, inline where a VMM hook makes a record per call. */
static inline __attribute__((always_inline)) bool remember_inline(enum alloc_kind kind, uint64_t value, uint64_t bytes,
                                                                  int slot, uint64_t aux)
{
    struct alloc_entry *t = atomic_load_explicit(&table, memory_order_acquire);
    if (CGPU_UNLIKELY(!t))
        return remember_first(kind, value, bytes, slot, aux);
    uint64_t key = make_key(kind, value);
    for (size_t n = 0, i = home(key); n < TABLE_SIZE; n++, i = (i + 1) & (TABLE_SIZE - 1)) {
        uint64_t cur = atomic_load_explicit(&t[i].key, memory_order_relaxed);
        if (cur != KEY_EMPTY && cur != KEY_TOMB)
            continue;
        /* Fill first, then publish the key: a reader who finds the key
         * finds the size with it. */
        if (atomic_compare_exchange_strong(&t[i].key, &cur, KEY_TOMB)) {
            t[i].value = value;
            t[i].bytes = bytes;
            t[i].slot = slot;
            t[i].aux = aux;
            atomic_store_explicit(&t[i].refs, 1, memory_order_relaxed);
            atomic_store_explicit(&t[i].key, key, memory_order_release);
            return true;
        }
    }
    return false;
}

static bool remember_aux(enum alloc_kind kind, uint64_t value, uint64_t bytes, int slot, uint64_t aux)
{
    return remember_inline(kind, value, bytes, slot, aux);
}

/* Records what an allocation holds. With the table full its bytes stay
 * charged (the safe side) and the log says so: the allocation stands. */
static CUresult keep(enum alloc_kind kind, uint64_t value, uint64_t bytes, int slot)
{
    if (!remember_aux(kind, value, bytes, slot, 0))
        cgpu_log(CGPU_LOG_ERROR, "allocation table full: %llu bytes stay charged", (unsigned long long)bytes);
    return CUDA_SUCCESS;
}

/* Puts a record back after the driver refused to free what it names. The
 * slot it left may have been taken meanwhile; then the record is lost and
 * its bytes stay charged until the process exits (its ledger is reaped). */
static void put_back(enum alloc_kind kind, uint64_t value, uint64_t bytes, int slot, uint64_t aux)
{
    if (!remember_aux(kind, value, bytes, slot, aux))
        cgpu_log(CGPU_LOG_ERROR, "allocation table full: a refused free's record is lost; %llu bytes stay charged",
                 (unsigned long long)bytes);
}

/* The live record, left in place; callers that change it serialise on
 * vmm_lock. Inline: a VMM cycle looks up three times. */
static inline __attribute__((always_inline)) struct alloc_entry *lookup(enum alloc_kind kind, uint64_t value)
{
    struct alloc_entry *t = atomic_load_explicit(&table, memory_order_acquire);
    if (!t)
        return NULL;
    uint64_t key = make_key(kind, value);
    for (size_t n = 0, i = home(key); n < TABLE_SIZE; n++, i = (i + 1) & (TABLE_SIZE - 1)) {
        uint64_t cur = atomic_load_explicit(&t[i].key, memory_order_acquire);
        if (cur == KEY_EMPTY)
            return NULL;
        if (cur == key && t[i].value == value)
            return &t[i];
    }
    return NULL;
}

/* Takes the record out; exactly one caller gets it. Inline: with lookup
 * inline too, a free makes no call here. */
static inline __attribute__((always_inline)) bool forget_aux(enum alloc_kind kind, uint64_t value, uint64_t *bytes,
                                                          int *slot, uint64_t *aux)
{
    /* Read before the exchange, which frees the entry for reuse; a record
     * another caller took meanwhile fails it: look again. */
    for (struct alloc_entry *e; (e = lookup(kind, value));) {
        uint64_t key = make_key(kind, value), b = e->bytes, a = e->aux;
        int s = e->slot;
        if (atomic_compare_exchange_strong(&e->key, &key, KEY_TOMB)) {
            *bytes = b;
            *slot = s;
            *aux = a;
            return true;
        }
    }
    return false;
}

static inline __attribute__((always_inline)) bool forget(enum alloc_kind kind, uint64_t value, uint64_t *bytes,
                                                              int *slot)
{
    uint64_t aux;
    return forget_aux(kind, value, bytes, slot, &aux);
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

/* The instance device every context of this process is on, when the driver
 * shows the process exactly one device and it is the instance's (a
 * container's usual view; CUDA_VISIBLE_DEVICES is fixed at cuInit); else
 * -1, not known yet or several. Saves asking the driver for the current
 * device at every allocation. */
#define ONLY_UNKNOWN (-1)
#define ONLY_NONE (-2)
static _Atomic int only_slot = ONLY_UNKNOWN;

/* Asked once a context exists (the driver is initialised then). */
static __attribute__((noinline, cold)) void learn_only_slot(void)
{
    int count = 0, slot = ONLY_NONE;
    __typeof__(&cuDeviceGetCount) get_count = REAL(cuDeviceGetCount);
    if (!get_count || get_count(&count) != CUDA_SUCCESS)
        return; /* ask again next time */
    if (count == 1 && cgpu_slot_of_cuda_device(0) >= 0)
        slot = cgpu_slot_of_cuda_device(0);
    atomic_store_explicit(&only_slot, slot, memory_order_relaxed);
}

static enum route route_current(int *slot)
{
    if (cgpu_state() != CGPU_ACTIVE)
        return route_to(-1);
    *slot = current_slot();
    if (*slot >= 0 && atomic_load_explicit(&only_slot, memory_order_relaxed) == ONLY_UNKNOWN)
        learn_only_slot();
    return route_to(*slot);
}

/* route_current for the allocation hooks, by value: the instance device
 * to charge, or ALLOC_FORWARD / ALLOC_REFUSE. */
#define ALLOC_FORWARD (-1)
#define ALLOC_REFUSE (-2)
static __attribute__((noinline, cold)) int route_alloc_slow(void)
{
    int slot = -1;
    switch (route_current(&slot)) {
    case ROUTE_FORWARD: return ALLOC_FORWARD;
    case ROUTE_REFUSE: return ALLOC_REFUSE;
    default: return slot;
    }
}

static __attribute__((noinline, cold)) bool no_context_after_all(void)
{
    return current_slot() == -2;
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

/* Charge `bytes`, make `call` (the driver's answer) and roll the charge back
 * if it fails; else return `settle`, evaluated only then. */
#define CHARGE_AROUND(slot, bytes, call, settle)                                                \
    do {                                                                                        \
        if (!charge(slot, bytes))                                                               \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                    \
        CUresult rc_ = (call);                                                                  \
        if (rc_ != CUDA_SUCCESS) {                                                              \
            uncharge(slot, bytes);                                                              \
            return rc_;                                                                         \
        }                                                                                       \
        return settle;                                                                          \
    } while (0)

/* Charge, call the driver, then remember what the result holds or roll back. */
#define CHARGED_CALL(kind, slot, bytes, key, symbol, ...) \
    CHARGE_AROUND(slot, bytes, CALL_REAL(symbol, __VA_ARGS__), keep(kind, (uint64_t)(key), bytes, slot))

/* Gives back what the freed object held, exactly once; if the driver
 * refuses the free, the record goes back. */
#define RELEASING_CALL(kind, value, symbol, ...)                                                \
    do {                                                                                        \
        uint64_t bytes_ = 0; /* both read only when held_ */                                   \
        int slot_ = -1;                                                                         \
        /* The state without initialising: no record exists before an allocation did. */       \
        bool held_ = atomic_load_explicit(&g_cgpu.state, memory_order_acquire) == CGPU_ACTIVE &&  \
                     forget(kind, (uint64_t)(value), &bytes_, &slot_);                          \
        CUresult rc_ = CALL_REAL(symbol, __VA_ARGS__);                                          \
        if (CGPU_LIKELY(held_)) {                                                               \
            if (CGPU_LIKELY(rc_ == CUDA_SUCCESS))                                               \
                uncharge(slot_, bytes_);                                                        \
            else                                                                                \
                put_back(kind, (uint64_t)(value), bytes_, slot_, 0);                            \
        }                                                                                       \
        return rc_;                                                                             \
    } while (0)

/* An allocation of `bytesize` bytes at *dptr on the current GPU, charged
 * before the driver is asked: one definition per entry point, `params` its
 * parameter list (naming dptr and bytesize), the rest its arguments. */
/* With only_slot known (ACTIVE by then) no driver call: a call without a
 * context is charged, refused by the driver and given back, and one the
 * limit refuses looks for a context before saying out of memory. */
#define ALLOC_HOOK(symbol, params, ...)                                                         \
    CGPU_EXPORT CUresult symbol params                                                          \
    {                                                                                           \
        if (CGPU_UNLIKELY(!dptr) || CGPU_UNLIKELY(!bytesize))                                   \
            return CALL_REAL(symbol, __VA_ARGS__);                                              \
        int slot = atomic_load_explicit(&only_slot, memory_order_relaxed);                      \
        bool assumed = slot >= 0;                                                               \
        if (CGPU_UNLIKELY(!assumed) && (slot = route_alloc_slow()) < 0)                         \
            return slot == ALLOC_FORWARD ? CALL_REAL(symbol, __VA_ARGS__) : CUDA_ERROR_OUT_OF_MEMORY; \
        if (CGPU_UNLIKELY(!charge(slot, bytesize)))                                             \
            return assumed && no_context_after_all() ? CALL_REAL(symbol, __VA_ARGS__) : CUDA_ERROR_OUT_OF_MEMORY; \
        CUresult rc_ = CALL_REAL(symbol, __VA_ARGS__);                                          \
        if (rc_ != CUDA_SUCCESS) {                                                              \
            uncharge(slot, bytesize);                                                           \
            return rc_;                                                                         \
        }                                                                                       \
        return keep(KIND_POINTER, (uint64_t)*dptr, bytesize, slot);                             \
    }

ALLOC_HOOK(cuMemAlloc_v2, (CUdeviceptr *dptr, size_t bytesize), dptr, bytesize)
ALLOC_HOOK(cuMemAlloc, (CUdeviceptr_v1 *dptr, unsigned int bytesize), dptr, bytesize)
/* Counted in full against the current GPU: managed memory can all become
 * resident there. */
ALLOC_HOOK(cuMemAllocManaged, (CUdeviceptr *dptr, size_t bytesize, unsigned int flags), dptr, bytesize, flags)
ALLOC_HOOK(cuMemAllocAsync, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream), dptr, bytesize, hStream)
ALLOC_HOOK(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream), dptr, bytesize, hStream)
ALLOC_HOOK(cuMemAllocFromPoolAsync, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream), dptr,
           bytesize, pool, hStream)
ALLOC_HOOK(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream),
           dptr, bytesize, pool, hStream)

/* Moves the charge of a pitched allocation from the guess to its real size;
 * frees it if the limit cannot take the difference. */
static CUresult settle_pitch(int slot, uint64_t guess, uint64_t real, CUdeviceptr ptr)
{
    if (real > guess && !charge(slot, real - guess)) {
        CALL_REAL(cuMemFree_v2, ptr);
        uncharge(slot, guess);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (real < guess)
        uncharge(slot, guess - real);
    return keep(KIND_POINTER, ptr, real, slot);
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
    CHARGE_AROUND(slot, guess, CALL_REAL(cuMemAllocPitch_v2, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes),
                  settle_pitch(slot, guess, (uint64_t)*pPitch * Height, *dptr));
}

CGPU_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                     unsigned int Height, unsigned int ElementSizeBytes)
{
    int slot = -1;
    uint64_t row = ((uint64_t)WidthInBytes + 511) & ~511ULL;
    bool sane = dptr && pPitch && WidthInBytes && Height;
    ROUTE_OR_RETURN(sane ? route_current(&slot) : ROUTE_FORWARD, cuMemAllocPitch, dptr, pPitch, WidthInBytes, Height,
                    ElementSizeBytes);
    uint64_t guess = row * Height;
    CHARGE_AROUND(slot, guess, CALL_REAL(cuMemAllocPitch, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes),
                  settle_pitch(slot, guess, (uint64_t)*pPitch * Height, *dptr));
}

/* Bytes of a W x H x D array level; 0 (forward, the driver rejects it)
 * when the description cannot be sized. */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned channels)
{
    uint64_t format = cgpu_array_format_bytes(f);
    uint64_t elem = (format ? format : 8) * (channels ? channels : 1); /* wider formats: count generously */
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
    case HOOK_cuArrayCreate: return CALL_REAL(cuArrayCreate, (CUarray *)out, desc);
    case HOOK_cuArray3DCreate: return CALL_REAL(cuArray3DCreate, (CUarray *)out, desc);
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
    CHARGE_AROUND(slot, bytes, call_array_create(id, out, desc, levels),
                  keep(KIND_ARRAY, (uint64_t)(uintptr_t)*out, bytes, slot));
}

/* One definition per array entry point and descriptor version; `depth`,
 * an expression of the descriptor d, is 0 for the 2D ones. */
#define ARRAY_HOOK(symbol, desc_t, depth)                                                       \
    CGPU_EXPORT CUresult symbol(CUarray *pHandle, const desc_t *d)                              \
    {                                                                                           \
        uint64_t bytes = d ? array_bytes(d->Width, d->Height, depth, d->Format, d->NumChannels) : 0; \
        return create_array((void **)pHandle, bytes, HOOK_##symbol, d, 0);                      \
    }

ARRAY_HOOK(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 0)
ARRAY_HOOK(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, d->Depth)
ARRAY_HOOK(cuArrayCreate, CUDA_ARRAY_DESCRIPTOR_v1, 0)
ARRAY_HOOK(cuArray3DCreate, CUDA_ARRAY3D_DESCRIPTOR_v1, d->Depth)

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

static bool refuse_graph_alloc(const CUgraphNodeParams *p)
{
    if (!p || p->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC || cgpu_state() == CGPU_PASSTHROUGH)
        return false;
    cgpu_log(CGPU_LOG_INFO, "graph memory nodes are not supported under a memory limit");
    return true;
}

CGPU_EXPORT CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                    size_t numDependencies, CUgraphNodeParams *nodeParams)
{
    if (refuse_graph_alloc(nodeParams))
        return CUDA_ERROR_NOT_SUPPORTED;
    return CALL_REAL(cuGraphAddNode, phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

CGPU_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                       const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                       CUgraphNodeParams *nodeParams)
{
    if (refuse_graph_alloc(nodeParams))
        return CUDA_ERROR_NOT_SUPPORTED;
    return CALL_REAL(cuGraphAddNode_v2, phGraphNode, hGraph, dependencies, dependencyData, numDependencies,
                     nodeParams);
}

CGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    RELEASING_CALL(KIND_POINTER, dptr, cuMemFree_v2, dptr);
}

CGPU_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    RELEASING_CALL(KIND_POINTER, dptr, cuMemFree, dptr);
}

CGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    RELEASING_CALL(KIND_POINTER, dptr, cuMemFreeAsync, dptr, hStream);
}

CGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    RELEASING_CALL(KIND_POINTER, dptr, cuMemFreeAsync_ptsz, dptr, hStream);
}

CGPU_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    RELEASING_CALL(KIND_ARRAY, (uintptr_t)hArray, cuArrayDestroy, hArray);
}

CGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    RELEASING_CALL(KIND_ARRAY, (uintptr_t)hMipmappedArray, cuMipmappedArrayDestroy, hMipmappedArray);
}

/* ---- VMM memory: alive until released and unmapped ------------------------------- */

/* Serialises finding a HANDLE record (by handle, or through a mapping)
 * with what changes its handle references or key, and taking mapping
 * records: whoever finds a record under it may take a reference, because
 * the one it found by stays until the lock is given back. References are
 * given back without it. Process-local, held for a few table operations
 * and never across a driver call: a spinlock, an exchange and a store
 * when free (a pthread mutex pair is ~50 instructions; a VMM cycle takes
 * it three times).
 * A waiter spins briefly, then sleeps between looks, so a holder that was
 * preempted gets the CPU back. */
static _Atomic int vmm_lock;

#define VMM_SPINS 128
#define VMM_PAUSE_NS 10000

static __attribute__((noinline, cold)) void vmm_lock_wait(void)
{
    unsigned spins = 0;
    do {
        while (atomic_load_explicit(&vmm_lock, memory_order_relaxed)) {
            if (++spins > VMM_SPINS) {
                struct timespec ts = {0, VMM_PAUSE_NS};
                nanosleep(&ts, NULL);
            }
        }
    } while (atomic_exchange_explicit(&vmm_lock, 1, memory_order_acquire));
}

static inline void vmm_take(void)
{
    if (CGPU_UNLIKELY(atomic_exchange_explicit(&vmm_lock, 1, memory_order_acquire)))
        vmm_lock_wait();
}

static inline void vmm_give(void)
{
    atomic_store_explicit(&vmm_lock, 0, memory_order_release);
}

/* An exported allocation stays charged to the exporter until it exits:
 * the file descriptor can keep the memory alive where we cannot see it. */
#define EXPORT_PIN (1 << 30)

void cgpu_memory_after_fork(void)
{
    atomic_store_explicit(&vmm_lock, 0, memory_order_relaxed); /* a holder's thread is gone */
}

static CUresult charge_imported(CUmemGenericAllocationHandle h);

/* The key of a detached record: its own address, which no look-up asks for. */
static uint64_t detached_key(const struct alloc_entry *mem)
{
    return make_key(KIND_DETACHED, (uint64_t)(uintptr_t)mem);
}

/* Records `bytes` (already charged) as held by `handle`, one reference.
 * Without vmm_lock: nobody names a record before it exists. Memory that is
 * not charged (host locations) is recorded too, with 0 bytes on slot 0, so
 * that a handle with no record is one cuMemMap can refuse (below). */
static inline void track_handle(CUmemGenericAllocationHandle handle, uint64_t bytes, int slot)
{
    if (!remember_inline(KIND_HANDLE, handle, bytes, slot, 1))
        cgpu_log(CGPU_LOG_ERROR, "allocation table full: %llu bytes stay charged", (unsigned long long)bytes);
}

/* One thing fewer keeps the memory alive; the last one gives its bytes
 * back. No lock: the count is atomic, and a record at zero is one nobody
 * can reach (detached, no mapping names it) and nobody can revive (a
 * look-up by handle or through a mapping finds only records with a
 * reference standing). */
static inline void unref_memory(struct alloc_entry *mem)
{
    if (atomic_fetch_sub_explicit(&mem->refs, 1, memory_order_acq_rel) != 1)
        return;
    uint64_t bytes = mem->bytes;
    int slot = mem->slot;
    atomic_store_explicit(&mem->key, KEY_TOMB, memory_order_release); /* only its own key was there */
    uncharge(slot, bytes);
}

/* The handle's record is attached again where it was (its key's probe
 * sequence passes there), unless another record took the handle value
 * meanwhile: then this memory keeps its reference for good (the safe
 * side) and the log says so. Caller holds vmm_lock. */
static void reattach_locked(struct alloc_entry *mem, CUmemGenericAllocationHandle handle)
{
    if (lookup(KIND_HANDLE, handle)) {
        cgpu_log(CGPU_LOG_ERROR, "handle %llu named twice: %llu bytes stay charged", (unsigned long long)handle,
                 (unsigned long long)mem->bytes);
        return;
    }
    mem->aux = 1;
    atomic_store_explicit(&mem->key, make_key(KIND_HANDLE, handle), memory_order_release);
}

/* Host locations (NCCL's host buffers) are not device memory: not charged,
 * but recorded (0 bytes) so that cuMemMap knows the handle. */
static __attribute__((noinline, cold)) CUresult create_uncharged(CUmemGenericAllocationHandle *handle, size_t size,
                                                                 const CUmemAllocationProp *prop,
                                                                 unsigned long long flags)
{
    CUresult rc = CALL_REAL(cuMemCreate, handle, size, prop, flags);
    if (rc == CUDA_SUCCESS && handle && cgpu_state() == CGPU_ACTIVE)
        track_handle(*handle, 0, 0);
    return rc;
}

CGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    bool device = handle && size && prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
    if (!device)
        return create_uncharged(handle, size, prop, flags);
    int slot = cgpu_state() == CGPU_ACTIVE ? cgpu_slot_of_cuda_device(prop->location.id) : -1;
    ROUTE_OR_RETURN(route_to(slot), cuMemCreate, handle, size, prop, flags);
    if (!charge(slot, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL_REAL(cuMemCreate, handle, size, prop, flags);
    if (rc != CUDA_SUCCESS) {
        uncharge(slot, size);
        return rc;
    }
    track_handle(*handle, size, slot);
    return CUDA_SUCCESS;
}

/* A refused release: the reference it took away comes back. */
static __attribute__((noinline, cold)) void release_refused(struct alloc_entry *mem, CUmemGenericAllocationHandle handle,
                                                            bool last)
{
    vmm_take();
    if (last)
        reattach_locked(mem, handle); /* its reference never went: alive */
    else if ((mem = lookup(KIND_HANDLE, handle)))
        mem->aux++;
    vmm_give();
}

/* The last handle reference detaches the record before the driver is
 * asked: once the driver has released the handle, a new allocation may
 * get the same value. Its reference on the memory goes once the driver
 * has said yes. The driver's release happens under vmm_lock, so that no
 * cuMemMap is between its look-up and the driver's map meanwhile (below). */
CGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    if (cgpu_state() != CGPU_ACTIVE)
        return CALL_REAL(cuMemRelease, handle);
    vmm_take();
    struct alloc_entry *mem = lookup(KIND_HANDLE, handle);
    bool last = mem && mem->aux <= 1;
    if (last) {
        mem->aux = 0;
        atomic_store_explicit(&mem->key, detached_key(mem), memory_order_relaxed);
    } else if (mem) {
        mem->aux--;
    }
    CUresult rc = CALL_REAL(cuMemRelease, handle);
    vmm_give();
    if (CGPU_LIKELY(rc == CUDA_SUCCESS)) {
        if (last)
            unref_memory(mem);
    } else if (mem) {
        release_refused(mem, handle, last);
    }
    return rc;
}

/* A retained handle is one more reference keeping the memory alive, even
 * after every earlier reference was released (the mapping named it). */
CGPU_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    CUresult rc = CALL_REAL(cuMemRetainAllocationHandle, handle, addr);
    if (rc != CUDA_SUCCESS || cgpu_state() != CGPU_ACTIVE)
        return rc;
    vmm_take();
    struct alloc_entry *mem = lookup(KIND_HANDLE, *handle), *m;
    bool held = mem != NULL;
    if (mem) {
        mem->aux++;
    } else if ((m = lookup(KIND_MAPPING, (uint64_t)(uintptr_t)addr)) && m->aux) {
        /* Alive while vmm_lock keeps the mapping's record (and reference)
         * where it is. Released while mapped: the driver gives back the
         * same handle (its value is the memory's while the memory lives). */
        mem = (struct alloc_entry *)(uintptr_t)m->aux;
        if (mem->aux == 0 && mem->value == *handle) {
            atomic_fetch_add_explicit(&mem->refs, 1, memory_order_relaxed);
            reattach_locked(mem, *handle);
            held = true;
        }
    }
    vmm_give();
    if (held)
        return CUDA_SUCCESS;
    /* An address inside a mapping, not its start, or a handle value the
     * memory's record does not have: charged again in full (the safe
     * side), as if imported. */
    return charge_imported(*handle);
}

/* A handle with no record: every handle made through us (create, import,
 * retain; host memory too) has one before the call that made it returns,
 * so this is a value the caller did not get from such a call yet: a guess
 * at what another thread's create is about to return, while that create
 * is between the driver and its record. Mapped untracked, the memory would
 * be given back at its release while still mapped (a way past the limit).
 * Called with vmm_lock held: lets it go once (the record may come
 * meanwhile) and looks again; returns the record with the lock held, or
 * NULL with it given back: refused, as the driver refuses a handle it does
 * not know. (A full table leaves a handle unrecorded too: refused as well.) */
static __attribute__((noinline, cold)) struct alloc_entry *map_unrecorded(CUmemGenericAllocationHandle handle)
{
    vmm_give();
    vmm_take();
    struct alloc_entry *mem = lookup(KIND_HANDLE, handle);
    if (!mem)
        vmm_give();
    return mem;
}

/* The mapping's reference is taken first, so that a release racing with
 * the map never sees the memory unused; and the driver maps under
 * vmm_lock, as the driver releases: otherwise the handle could be
 * released and handed to a new allocation between the look-up and the
 * driver's map, which would then map memory whose record is not the one
 * charged for it (the new one's charge goes at its release while this
 * mapping keeps it alive). */
CGPU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags)
{
    if (cgpu_state() != CGPU_ACTIVE)
        return CALL_REAL(cuMemMap, ptr, size, offset, handle, flags);
    vmm_take();
    struct alloc_entry *mem = lookup(KIND_HANDLE, handle);
    if (CGPU_UNLIKELY(!mem) && !(mem = map_unrecorded(handle)))
        return CUDA_ERROR_INVALID_VALUE;
    atomic_fetch_add_explicit(&mem->refs, 1, memory_order_relaxed);
    CUresult rc = CALL_REAL(cuMemMap, ptr, size, offset, handle, flags);
    vmm_give();
    if (rc != CUDA_SUCCESS)
        unref_memory(mem);
    else if (!remember_inline(KIND_MAPPING, ptr, size, -1, (uint64_t)(uintptr_t)mem))
        cgpu_log(CGPU_LOG_ERROR, "allocation table full: a mapping stays charged");
    return rc;
}

#define UNMAP_BATCH 64

/* Settles an unmap whose first mapping, [ptr, ptr + first), was taken
 * and does not cover the range: as many mappings as follow it in the
 * range, taken before the driver is asked (up to UNMAP_BATCH; the rest
 * are settled after) and given back if it refuses. */
static __attribute__((noinline, cold)) CUresult unmap_many(CUdeviceptr ptr, size_t size, uint64_t first,
                                                          uint64_t first_mem)
{
    struct {
        CUdeviceptr at;
        uint64_t bytes, mem;
    } taken[UNMAP_BATCH] = {{ptr, first, first_mem}};
    int n = 1, slot;
    CUdeviceptr at = ptr + first, end = ptr + size >= ptr ? ptr + size : ~(CUdeviceptr)0;
    vmm_take();
    while (n < UNMAP_BATCH && at < end &&
           forget_aux(KIND_MAPPING, at, &taken[n].bytes, &slot, &taken[n].mem) && taken[n].bytes) {
        taken[n].at = at;
        at += taken[n++].bytes;
    }
    vmm_give();
    CUresult rc = CALL_REAL(cuMemUnmap, ptr, size);
    for (int i = 0; i < n; i++) {
        if (rc != CUDA_SUCCESS)
            put_back(KIND_MAPPING, taken[i].at, taken[i].bytes, -1, taken[i].mem);
        else if (taken[i].mem)
            unref_memory((struct alloc_entry *)(uintptr_t)taken[i].mem);
    }
    if (rc == CUDA_SUCCESS && at < end && n == UNMAP_BATCH) {
        uint64_t bytes, mem;
        vmm_take();
        while (at < end && forget_aux(KIND_MAPPING, at, &bytes, &slot, &mem) && bytes) {
            if (mem)
                unref_memory((struct alloc_entry *)(uintptr_t)mem);
            at += bytes;
        }
        vmm_give();
    }
    return rc;
}

/* One unmap may cover several mappings (unmap_many). A mapping's record
 * goes before the driver is asked (the range can be mapped again the
 * moment it returns) and comes back if it refuses. Records are taken under
 * vmm_lock (a retain reads a mapping's memory under it); references are
 * given back without it. The usual unmap, of one whole mapping, is
 * settled here. */
CGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    if (cgpu_state() != CGPU_ACTIVE)
        return CALL_REAL(cuMemUnmap, ptr, size);
    uint64_t bytes = 0, mem = 0;
    vmm_take();
    /* Only unmaps take mapping records, all under vmm_lock: no race for it. */
    struct alloc_entry *m = lookup(KIND_MAPPING, ptr);
    bool held = m != NULL;
    if (held) {
        bytes = m->bytes;
        mem = m->aux;
        atomic_store_explicit(&m->key, KEY_TOMB, memory_order_release);
    }
    vmm_give();
    if (held && bytes < size)
        return unmap_many(ptr, size, bytes, mem);
    CUresult rc = CALL_REAL(cuMemUnmap, ptr, size);
    if (!held)
        return rc; /* nothing of ours started there: nothing more in the range either */
    if (rc != CUDA_SUCCESS)
        put_back(KIND_MAPPING, ptr, bytes, -1, mem);
    else if (mem)
        unref_memory((struct alloc_entry *)(uintptr_t)mem);
    return rc;
}

CGPU_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                  CUmemAllocationHandleType handleType, unsigned long long flags)
{
    CUresult rc = CALL_REAL(cuMemExportToShareableHandle, shareableHandle, handle, handleType, flags);
    if (rc != CUDA_SUCCESS || cgpu_state() != CGPU_ACTIVE)
        return rc;
    vmm_take();
    struct alloc_entry *mem = lookup(KIND_HANDLE, handle);
    if (mem)
        atomic_fetch_or_explicit(&mem->refs, EXPORT_PIN, memory_order_relaxed);
    vmm_give();
    return rc;
}

/* The size of memory behind an imported handle: the driver has no query for
 * it, but maps only what exists, so the largest mapping that succeeds at
 * offset 0 is the size. Searched in granules up to one granule past the
 * limit (anything larger is refused anyway); *bytes is 0 for host memory. */
static CUresult imported_size(CUmemGenericAllocationHandle h, uint64_t *bytes, int *slot)
{
    CUmemAllocationProp prop;
    CUresult rc = CALL_REAL(cuMemGetAllocationPropertiesFromHandle, &prop, h);
    *bytes = 0;
    *slot = -1;
    if (rc != CUDA_SUCCESS || prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return rc;
    if ((*slot = cgpu_slot_of_cuda_device(prop.location.id)) < 0)
        return CUDA_ERROR_OUT_OF_MEMORY; /* a GPU outside the instance */
    size_t gran = 0;
    rc = CALL_REAL(cuMemGetAllocationGranularity, &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc != CUDA_SUCCESS || gran == 0)
        return rc ? rc : CUDA_ERROR_INVALID_VALUE;
    uint64_t most = cgpu_mem_limit(*slot) / gran + 1;
    CUdeviceptr va;
    if ((rc = CALL_REAL(cuMemAddressReserve, &va, (size_t)(most * gran), 0, 0, 0)) != CUDA_SUCCESS)
        return rc;
    uint64_t lo = 0, hi = most + 1; /* lo granules map, hi do not */
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (CALL_REAL(cuMemMap, va, (size_t)(mid * gran), 0, h, 0) == CUDA_SUCCESS) {
            CALL_REAL(cuMemUnmap, va, (size_t)(mid * gran));
            lo = mid;
        } else {
            hi = mid;
        }
    }
    CALL_REAL(cuMemAddressFree, va, (size_t)(most * gran));
    *bytes = lo * gran;
    return lo ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Charges the memory behind `h` in full and records it; on a refusal the
 * reference the caller just got is given back, so it holds nothing. */
static CUresult charge_imported(CUmemGenericAllocationHandle h)
{
    uint64_t bytes;
    int slot;
    CUresult sized = imported_size(h, &bytes, &slot);
    if (sized == CUDA_SUCCESS && bytes == 0) {
        track_handle(h, 0, 0); /* host memory: known, not charged */
        return CUDA_SUCCESS;
    }
    if (sized != CUDA_SUCCESS || !charge(slot, bytes)) {
        CALL_REAL(cuMemRelease, h);
        return sized != CUDA_SUCCESS ? sized : CUDA_ERROR_OUT_OF_MEMORY;
    }
    track_handle(h, bytes, slot);
    return CUDA_SUCCESS;
}

/* Memory another process exported is resident on the device whatever the
 * exporter does next: the importer pays for it in full. */
CGPU_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                    CUmemAllocationHandleType shHandleType)
{
    switch (handle ? cgpu_state() : CGPU_PASSTHROUGH) {
    case CGPU_ACTIVE: break;
    case CGPU_BROKEN: return CUDA_ERROR_OUT_OF_MEMORY; /* fail closed */
    default: return CALL_REAL(cuMemImportFromShareableHandle, handle, osHandle, shHandleType);
    }
    CUresult rc = CALL_REAL(cuMemImportFromShareableHandle, handle, osHandle, shHandleType);
    if (rc != CUDA_SUCCESS)
        return rc;
    return charge_imported(*handle);
}

/* ---- context limits that reserve device memory ------------------------------------ */

/* Bytes the driver reserves for a limit's value: the heap and the printf
 * FIFO as set; the stack for every thread the GPU can hold resident. */
static uint64_t limit_bytes(CUlimit which, uint64_t value, CUdevice dev)
{
    if (which != CU_LIMIT_STACK_SIZE)
        return value;
    int sms = 0, threads = 0;
    CALL_REAL(cuDeviceGetAttribute, &sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
    CALL_REAL(cuDeviceGetAttribute, &threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev);
    uint64_t n = (uint64_t)(sms > 0 ? sms : 1) * (uint64_t)(threads > 0 ? threads : 1);
    return value > UINT64_MAX / n ? UINT64_MAX : value * n;
}

/* Growth past the value found at the first call is charged, before the
 * driver is asked; shrinking gives back what was charged. What a context
 * reserves at creation is the driver's overhead, not charged anywhere. */
CGPU_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    bool memory = limit == CU_LIMIT_STACK_SIZE || limit == CU_LIMIT_MALLOC_HEAP_SIZE ||
                  limit == CU_LIMIT_PRINTF_FIFO_SIZE;
    int slot = -1;
    ROUTE_OR_RETURN(memory ? route_current(&slot) : ROUTE_FORWARD, cuCtxSetLimit, limit, value);
    CUcontext ctx = NULL;
    CUdevice dev;
    size_t before = 0;
    if (CALL_REAL(cuCtxGetCurrent, &ctx) != CUDA_SUCCESS || !ctx || CALL_REAL(cuCtxGetDevice, &dev) != CUDA_SUCCESS ||
        CALL_REAL(cuCtxGetLimit, &before, limit) != CUDA_SUCCESS)
        return CALL_REAL(cuCtxSetLimit, limit, value); /* the driver's error to give */
    uint64_t old_b = limit_bytes(limit, before, dev), new_b = limit_bytes(limit, value, dev);
    uint64_t grow = new_b > old_b ? new_b - old_b : 0;
    if (grow && !charge(slot, grow))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CALL_REAL(cuCtxSetLimit, limit, value);
    if (rc != CUDA_SUCCESS) {
        if (grow)
            uncharge(slot, grow);
        return rc;
    }
    /* Settle on the value the driver really took (it rounds). */
    size_t after = value;
    CALL_REAL(cuCtxGetLimit, &after, limit);
    uint64_t real_b = limit_bytes(limit, after, dev);
    uint64_t key = ((uint64_t)(uintptr_t)ctx << 4) | ((uint64_t)limit << 2), held = 0, aux;
    int s;
    vmm_take();
    forget_aux(KIND_LIMIT, key, &held, &s, &aux);
    if (real_b >= old_b) {
        uint64_t want = real_b - old_b;
        if (want > grow && !charge(slot, want - grow))
            want = grow; /* the driver gave more than asked and the limit is full: keep what we have */
        else if (want < grow)
            uncharge(slot, grow - want);
        held += want;
    } else {
        uint64_t give = old_b - real_b < held ? old_b - real_b : held;
        if (grow)
            uncharge(slot, grow);
        uncharge(slot, give);
        held -= give;
    }
    if (held && !remember_aux(KIND_LIMIT, key, held, slot, 0))
        cgpu_log(CGPU_LOG_ERROR, "allocation table full: %llu bytes stay charged", (unsigned long long)held);
    vmm_give();
    return CUDA_SUCCESS;
}

/* ---- memory as the instance sees it ------------------------------------------------ */

/* The instance's free and total memory on the current device, given what
 * the driver says is free on the GPU. False without an instance device. */
static void instance_mem_info(uint64_t gpu_free, uint64_t *free_bytes, uint64_t *total)
{
    cgpu_reap_dead();
    /* The driver has just answered for the current context: with one
     * device visible it is on that one. */
    int slot = atomic_load_explicit(&only_slot, memory_order_relaxed);
    if (slot < 0) {
        slot = current_slot();
        if (slot >= 0 && atomic_load_explicit(&only_slot, memory_order_relaxed) == ONLY_UNKNOWN)
            learn_only_slot();
    }
    uint64_t limit = slot >= 0 ? cgpu_mem_limit(slot) : 0;
    uint64_t used = slot >= 0 ? cgpu_slot_used(slot) : 0;
    uint64_t left = used < limit ? limit - used : 0;
    /* Never more than the GPU really has free: other tenants may hold it. */
    *free_bytes = left < gpu_free ? left : gpu_free;
    *total = limit;
}

/* The memory queries, one definition per entry point: the driver first (it
 * validates the arguments and the context), then the instance's figures,
 * `narrow`ed to the entry point's `type`. */
#define MEMINFO_HOOK(symbol, type, narrow)                                                      \
    CGPU_EXPORT CUresult symbol(type *free_bytes, type *total)                                  \
    {                                                                                           \
        CUresult rc = CALL_REAL(symbol, free_bytes, total);                                     \
        if (rc != CUDA_SUCCESS || cgpu_state() != CGPU_ACTIVE)                                  \
            return rc;                                                                          \
        uint64_t f, t;                                                                          \
        instance_mem_info(*free_bytes, &f, &t);                                                 \
        *free_bytes = narrow(f);                                                                \
        *total = narrow(t);                                                                     \
        return rc;                                                                              \
    }

#define TOTALMEM_HOOK(symbol, type, narrow)                                                     \
    CGPU_EXPORT CUresult symbol(type *bytes, CUdevice dev)                                      \
    {                                                                                           \
        CUresult rc = CALL_REAL(symbol, bytes, dev);                                            \
        if (rc != CUDA_SUCCESS || cgpu_state() != CGPU_ACTIVE)                                  \
            return rc;                                                                          \
        int slot = cgpu_slot_of_cuda_device(dev);                                               \
        *bytes = slot >= 0 ? narrow(cgpu_mem_limit(slot)) : 0;                                  \
        return rc;                                                                              \
    }

static size_t as_size(uint64_t v)
{
    return (size_t)v;
}

static unsigned int clamp32(uint64_t v)
{
    return v > UINT_MAX ? UINT_MAX : (unsigned int)v;
}

MEMINFO_HOOK(cuMemGetInfo_v2, size_t, as_size)
/* The 32-bit view: the driver's own free figure is already clamped, and
 * may be below the instance's real free memory; never above it. */
MEMINFO_HOOK(cuMemGetInfo, unsigned int, clamp32)
TOTALMEM_HOOK(cuDeviceTotalMem_v2, size_t, as_size)
TOTALMEM_HOOK(cuDeviceTotalMem, unsigned int, clamp32)
