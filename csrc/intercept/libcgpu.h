/* Internals of libcgpu.so shared by its source files.
 *
 * Ownership: one process-wide `g_cgpu`, set up once by cgpu_init() and then
 * read-only but for the ledger fields that fork resets. Thread-safety: hot
 * paths read `state` and the real-function cache with plain atomic loads;
 * the usage and grants regions are atomics; only ledger claim/reap, the
 * launch gate's slow path and the VMM/context-limit bookkeeping (memory.c)
 * take process-local mutexes (never held across a driver call). */
#ifndef CGPU_LIBCGPU_H
#define CGPU_LIBCGPU_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cgpu/cuda_abi.h"
#include "cgpu/nvml_abi.h"
#include "cgpu/region.h"

#define CGPU_EXPORT __attribute__((visibility("default")))
/* On declarations too: the hot paths then address these directly, not
 * through the GOT. */
#define CGPU_HIDDEN __attribute__((visibility("hidden")))
#define CGPU_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define CGPU_LIKELY(x) __builtin_expect(!!(x), 1)

enum cgpu_hook_id {
#define HOOK(symbol, library) HOOK_##symbol,
#define USE HOOK
#include "hooks.def"
#undef USE
#undef HOOK
    HOOK_COUNT
};

enum cgpu_state {
    CGPU_UNINIT = 0,
    CGPU_PASSTHROUGH, /* no region: the library changes nothing */
    CGPU_ACTIVE,      /* limits enforced */
    CGPU_BROKEN,      /* a region exists but cannot be trusted: allocations fail closed */
};

struct cgpu_device_view {
    char uuid[CGPU_UUID_LEN];
    _Atomic uint64_t file_limit;      /* the limits file's, as read at init */
    const _Atomic uint64_t *mem_limit; /* the live one: in the grants mapping (a resize
                                        * stores there), else file_limit */
};

struct cgpu_process {
    _Atomic int state;             /* enum cgpu_state */
    int log_level;
    unsigned device_count;
    struct cgpu_device_view device[CGPU_MAX_DEVICES]; /* private copy of the limits */
    struct cgpu_usage *usage;      /* shared, writable */
    int usage_fd;                  /* holds this process's ledger lock */
    int ledger;                    /* -1 until claimed (again, after fork) */
    char usage_path[4096];
    pthread_mutex_t ledger_lock;   /* claim and reap */
    /* Per device slot: its gate word in the grants mapping, or a static word
     * (UNGATED without compute control, closed when launches are refused),
     * so the launch path never tests for NULL. */
    const _Atomic uint32_t *gate[CGPU_MAX_DEVICES];
    /* What the launch hooks read first: gate[0] once init is done and the
     * process has at most one instance device, else a word that is neither
     * ungated nor open (before init, several devices), which sends every
     * launch to the full path. Stored once, after init. */
    const _Atomic uint32_t *_Atomic launch_gate;
    int grants_fd;                 /* read-only: probes cgpud's lock on it (CGPU_GRANTS_LOCK_OFFSET) */
    bool launches_refused;         /* a grants file that cannot be trusted */
    char refused_why[512];         /* said at the first refused launch; empty: said already */
};

extern CGPU_HIDDEN struct cgpu_process g_cgpu;

/* Reads the region once; later calls return at once. */
void cgpu_init_slow(void);

/* The instance region's directory: the mounted one inside a container,
 * else CGPU_REGION_DIR; NULL for none. */
const char *cgpu_region_dir(void);
/* Claims this process's ledger; the caller holds g_cgpu.ledger_lock. */
int cgpu_claim_ledger_locked(void);
static inline int cgpu_state(void)
{
    int s = atomic_load_explicit(&g_cgpu.state, memory_order_acquire);
    if (CGPU_UNLIKELY(s == CGPU_UNINIT)) {
        cgpu_init_slow();
        s = atomic_load_explicit(&g_cgpu.state, memory_order_acquire);
    }
    return s;
}

void cgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- the real functions ------------------------------------------------------ */

extern CGPU_HIDDEN void *_Atomic g_real[HOOK_COUNT];
extern void *const g_hook[HOOK_COUNT]; /* NULL for USE entries */
extern const char *const g_hook_name[HOOK_COUNT];
void *cgpu_resolve_real(enum cgpu_hook_id id);

static inline void *cgpu_real(enum cgpu_hook_id id)
{
    void *p = atomic_load_explicit(&g_real[id], memory_order_acquire);
    return p ? p : cgpu_resolve_real(id);
}

/* The driver's own implementation of `symbol`, typed like our declaration. */
#define REAL(symbol) ((__typeof__(&symbol))cgpu_real(HOOK_##symbol))

/* Our hook for a pointer the driver handed out, or the pointer itself. */
void *cgpu_substitute(void *real_fn);
/* Our hook for a symbol name, or NULL if we do not hook it. */
void *cgpu_hook_by_name(const char *name);

/* ---- launch gating (launch.c) ------------------------------------------------ */

/* Process-local gate state goes with the threads a fork leaves behind.
 * Async-signal-safe. */
void cgpu_gate_after_fork(void);

/* ---- memory accounting (memory.c) -------------------------------------------- */

/* Process-local VMM bookkeeping goes with the threads a fork leaves
 * behind. Async-signal-safe. */
void cgpu_memory_after_fork(void);

/* The memory limit of an instance device now: a resize may change it. */
static inline uint64_t cgpu_mem_limit(int slot)
{
    return atomic_load_explicit(g_cgpu.device[slot].mem_limit, memory_order_relaxed);
}

/* Index of the instance device the CUDA ordinal / NVML handle is, or -1. */
int cgpu_slot_of_cuda_device(CUdevice dev);
int cgpu_slot_of_nvml_device(nvmlDevice_t dev);
uint64_t cgpu_slot_used(int slot);
/* Returns the usage of dead processes to the instance; count reaped. */
int cgpu_reap_dead(void);
/* PIDs holding a live ledger in this instance. */
bool cgpu_pid_in_instance(unsigned int pid);

#endif
