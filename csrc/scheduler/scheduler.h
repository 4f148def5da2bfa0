/* Time-slice compute scheduler core: per-GPU decisions only, driven by cgpud.
 * Ownership and threads: the caller owns a cgpu_sched from create to destroy and
 * drives it from one thread at a time; it holds no globals and never allocates
 * after create, never reads a clock, never blocks.
 *
 * How the caller drives one GPU: report each tenant's demand, ask next(now) who
 * may launch work and for how long, let that tenant run, then charge it the
 * device time it really used (a kernel that outlives the slice is charged in
 * full; the account remembers it so long kernels cannot steal share). next() may
 * be called again early, e.g. when a tenant reports new work during an idle
 * decision: slice_ns is the longest the decision stays valid, not a promise.
 * All times are nanoseconds on one monotonic clock the caller chooses.
 *
 * This header is also the cffi cdef (build_scheduler.py): no macros other than
 * plain integer #defines, no inline code, C comments only. */
#ifndef CGPU_SCHEDULER_H
#define CGPU_SCHEDULER_H

#include <stdint.h>

#define CGPU_SCHED_ABI_VERSION 3

#define CGPU_SCHED_MAX_GPUS 16
#define CGPU_SCHED_MAX_TENANTS 32

/* Accepted ranges of cgpu_sched_configure. The soft policy promises that a
 * tenant whose work comes back reclaims its share within 100 ms; slices longer
 * than CGPU_SCHED_SOFT_MAX_SLICE_NS could not keep that promise. */
#define CGPU_SCHED_MIN_PERIOD_NS 1000000
#define CGPU_SCHED_MAX_PERIOD_NS 1000000000
#define CGPU_SCHED_MIN_SLICE_NS 10000
#define CGPU_SCHED_SOFT_MAX_SLICE_NS 20000000

/* What a GPU uses until it is configured: native, i.e. no compute control.
 * Also cgpud's defaults (compute_period_ms, compute_slice_ms). */
#define CGPU_SCHED_DEFAULT_PERIOD_NS 100000000
#define CGPU_SCHED_DEFAULT_SLICE_NS 10000000

/* Policies, numbered as cGPU numbers them. "Reserved" time is held for its
 * tenant in every period, paced over it; under fixed it idles when that
 * tenant has no work, under fair it is lent meanwhile (a lent slice ends
 * when a paced tenant is due, is not charged to the borrower's reservation,
 * and leaves no debt unless a kernel outlasts it).
 * High-priority tenants with work go first in each period until their usage
 * reaches high_prio_percent of it; under fair and fixed that only reorders
 * their own reservation. */
enum cgpu_sched_policy {
    CGPU_SCHED_FAIR = 0,       /* every tenant reserved period / tenants; time
                                  nobody may use by reservation is lent to the
                                  tenants with work, most owed first */
    CGPU_SCHED_PREEMPTIVE = 1, /* equal shares among tenants with work, never idle */
    CGPU_SCHED_WEIGHTED = 2,   /* shares by weight among tenants with work, never idle */
    CGPU_SCHED_FIXED = 3,      /* share_percent reserved, never more; memory-only
                                  tenants split the unreserved rest */
    CGPU_SCHED_SOFT = 4,       /* share_percent guaranteed, idle share lent by
                                  share; memory-only tenants guaranteed the rest */
    CGPU_SCHED_NATIVE = 5      /* no control: next() returns CGPU_SCHED_UNGATED */
};

/* Results: 0 success; CGPU_SCHED_UNGATED from next() under the native policy
 * (the caller must not gate at all); otherwise a negative errno value. Nothing
 * changes when a call fails. */
enum cgpu_sched_status {
    CGPU_SCHED_OK = 0,
    CGPU_SCHED_UNGATED = 1,
    CGPU_SCHED_ENOENT = -2,   /* no tenant with that key on that GPU */
    CGPU_SCHED_ENODEV = -19,  /* GPU index out of range */
    CGPU_SCHED_EINVAL = -22,  /* bad argument: zero key, NULL, value out of range */
    CGPU_SCHED_ENOSPC = -28,  /* tenant table of the GPU is full */
    CGPU_SCHED_EDQUOT = -122  /* the shares on the GPU would add up to more than 100 */
};

/* key 0 means nobody may launch: the GPU idles for at most slice_ns. */
struct cgpu_sched_decision {
    uint64_t key;
    uint64_t slice_ns;
};

struct cgpu_sched_config {
    int policy;
    uint64_t period_ns;
    uint64_t max_slice_ns;
    unsigned high_prio_percent;
};

/* A snapshot for metrics and tests. lag_ns: device time the tenant is owed
 * (negative: it owes, e.g. after an overrun) under the proportional accounts;
 * budget_ns: what is left of its reservation in the current period (fair and
 * fixed). */
struct cgpu_sched_tenant_info {
    uint64_t key;
    unsigned share_percent;
    unsigned weight;
    int high_priority;
    int has_work;
    uint64_t charged_ns;
    int64_t lag_ns;
    int64_t budget_ns;
};

struct cgpu_sched;

int cgpu_sched_abi_version(void);
/* NULL when gpu_count is 0 or above CGPU_SCHED_MAX_GPUS, or out of memory. */
struct cgpu_sched *cgpu_sched_create(unsigned gpu_count);
unsigned cgpu_sched_gpu_count(const struct cgpu_sched *s);
void cgpu_sched_destroy(struct cgpu_sched *s);

/* Starts the GPU's accounting afresh (tenants and demand stay). */
int cgpu_sched_configure(struct cgpu_sched *s, unsigned gpu, int policy, uint64_t period_ns,
                         uint64_t max_slice_ns, unsigned high_prio_percent);
int cgpu_sched_config_get(const struct cgpu_sched *s, unsigned gpu, struct cgpu_sched_config *out);

/* Adds or updates a tenant. share_percent 0..100 (0: memory-only, nothing
 * reserved), weight 1..100 (used by the weighted policy). */
int cgpu_sched_tenant_set(struct cgpu_sched *s, unsigned gpu, uint64_t key, unsigned share_percent,
                          unsigned weight, int high_priority);
int cgpu_sched_tenant_remove(struct cgpu_sched *s, unsigned gpu, uint64_t key);
/* Number of tenants on the GPU, or a negative status. */
int cgpu_sched_tenant_count(const struct cgpu_sched *s, unsigned gpu);
int cgpu_sched_tenant_get(const struct cgpu_sched *s, unsigned gpu, uint64_t key,
                          struct cgpu_sched_tenant_info *out);

/* now_ns: when the demand was seen, so the core can tell a gap of a moment
 * (a thread late back to its gate) from an idle spell. */
int cgpu_sched_demand(struct cgpu_sched *s, unsigned gpu, uint64_t key, int has_work, uint64_t now_ns);
int cgpu_sched_charge(struct cgpu_sched *s, unsigned gpu, uint64_t key, uint64_t busy_ns);
int cgpu_sched_next(struct cgpu_sched *s, unsigned gpu, uint64_t now_ns, struct cgpu_sched_decision *out);

#endif
