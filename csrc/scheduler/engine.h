/* The compute scheduler's engine: drives the decision core (scheduler.h) for
 * each GPU against the instances' shared regions, in cgpud, without the GIL.
 *
 * Per GPU, cgpu_engine_run() loops: read each tenant's demand from its usage
 * file, ask the core who holds the GPU, open that tenant's gate in its grants
 * file, sleep until the slice ends (or something changes, or the holder's
 * processes all report idle while another tenant waits), close the gate,
 * wait until every process of the tenant has fenced its work in flight, and
 * charge the tenant from grant to fence: the device time it really used.
 * The protocol is in cgpu/region.h.
 *
 * Ownership: the caller owns an engine from create to destroy; the engine maps
 * each attached tenant's grants and usage files until detach. Thread-safety:
 * every function may be called from any thread; one thread per GPU runs
 * cgpu_engine_run; a mutex inside guards the tables (this is cgpud's own
 * memory: no other process can hold it). Tenant processes are never trusted:
 * what they write can delay their own grants, never another tenant's beyond
 * the fence timeout. While a tenant is attached the engine holds an OFD lock
 * on its grants file (CGPU_GRANTS_LOCK_OFFSET) so its processes can tell a
 * closed gate from a dead cgpud.
 *
 * This header is also part of the cffi cdef (build_scheduler.py): plain
 * integer #defines only, no inline code, C comments only. */
#ifndef CGPU_ENGINE_H
#define CGPU_ENGINE_H

#include <stdint.h>

/* A closed gate waits this long for the processes' fence acknowledgements
 * before the next tenant is granted anyway (a kernel longer than that, a
 * stopped or hung process). The late tenant is charged on until its fence
 * arrives and is not granted meanwhile. */
#define CGPU_ENGINE_FENCE_TIMEOUT_NS 50000000
/* Until this long after a closing whose fence is overdue, nobody else is
 * granted the GPU: on it runs the late tenant's kernel, for which that
 * tenant is charged, and a grant meanwhile would charge another tenant for
 * time it cannot use. Past it (a process stopped or hung rather than a long
 * kernel) the others are granted again. */
#define CGPU_ENGINE_OVERDUE_HOLD_NS 250000000
/* A closed gate looks for processes that died without acknowledging after
 * this long without an acknowledgement, and again every time as long. */
#define CGPU_ENGINE_FENCE_PROBE_NS 4000000
/* With someone who might report work, an idle GPU looks this often. */
#define CGPU_ENGINE_IDLE_POLL_NS 1000000
/* A holder whose every process reports idle (region.h) is passed over once
 * it has stayed so this long while another tenant waits: long enough for a
 * program that synchronises after each kernel to launch its next one, short
 * next to a slice. */
#define CGPU_ENGINE_IDLE_GRACE_NS 100000
/* A holder that has shown it stays idle (CGPU_ENGINE_GRACE_LEARN hand-overs
 * in a row after which it did not come back to its gate within a full grace)
 * has this grace instead, none: it is passed over at the first look that
 * finds it idle. An inference server between requests would otherwise leave
 * the GPU idle for the whole grace after every burst. A tenant found back at
 * its gate within a full grace of such a hand-over has the full grace again,
 * and needs twice as many quiet hand-overs (at most
 * CGPU_ENGINE_GRACE_LEARN_MAX) before the next short one. Whatever a tenant
 * writes decides only how soon it loses the GPU itself. */
#define CGPU_ENGINE_IDLE_GRACE_SHORT_NS 0
#define CGPU_ENGINE_GRACE_LEARN 3
#define CGPU_ENGINE_GRACE_LEARN_MAX 256
/* While the holder is idle and nobody waits, the loop looks for a waiter this
 * often at first, backing off to CGPU_ENGINE_IDLE_POLL_NS. */
#define CGPU_ENGINE_IDLE_WATCH_NS 250000
/* After its bell rang and the holder was found busy, the loop looks again
 * this much later without listening to the bell: a tenant can ring it at
 * will, and one that synchronises often reports idle often. */
#define CGPU_ENGINE_IDLE_RECHECK_NS 1000000
/* Achieved shares are measured over windows this long (at the loop's next
 * turn after one ends): long enough to span ten default periods. */
#define CGPU_ENGINE_SHARE_WINDOW_NS 1000000000
/* While the tenants pace themselves, the loop looks this often for threads
 * waiting at a paced gate: processes whose libcgpu predates pacing (they
 * would wait for a grant that never comes). Found twice in a row, the GPU
 * goes back to slices until its tenants or policy change. */
#define CGPU_ENGINE_PACED_LOOK_NS 250000000
/* Busy windows (CGPU_ENGINE_WINDOWS_BUSY): the slices must have found every
 * tenant with work at every turn, and none passed over idle, for this long
 * before the tenants keep to windows by themselves; twice as long after
 * each time the windows ended for want of use, up to
 * CGPU_ENGINE_BUSY_BACKOFF_MAX doublings, until the tenants or the policy
 * change (work the windows do not fit stays in slices). */
#define CGPU_ENGINE_BUSY_PROOF_NS 500000000
#define CGPU_ENGINE_BUSY_BACKOFF_MAX 7
/* While busy windows last, each tenant's paced device time is weighed over
 * this long: one that used less than CGPU_ENGINE_BUSY_FILL_PERCENT of its
 * windows (one window's lag allowed: it is counted as each window ends)
 * brings the slices back, which lend its idle time and fill what the
 * windows did not. */
#define CGPU_ENGINE_BUSY_FILL_NS 2000000000
#define CGPU_ENGINE_BUSY_FILL_PERCENT 90
/* cgpu_engine_set_windows: which policies may leave their tenants to windows. */
#define CGPU_ENGINE_WINDOWS_FIXED 1
#define CGPU_ENGINE_WINDOWS_BUSY 2

struct cgpu_engine_stats {
    uint64_t decisions;
    uint64_t grants;          /* gate openings */
    uint64_t fences;          /* gate closings that were acknowledged */
    uint64_t fence_timeouts;  /* closings that ran into CGPU_ENGINE_FENCE_TIMEOUT_NS */
    uint64_t fences_late;     /* of those, fenced later (charged until then, not granted meanwhile) */
    uint64_t fence_wait_ns;   /* total time from closing to acknowledgement */
    uint64_t idle_handovers;  /* grants ended early: the holder was idle and another tenant waited */
    uint64_t busy_ended;      /* busy windows ended because a tenant left its windows idle */
    uint64_t holder;          /* key holding the GPU now, 0 for none */
    int tenants;
    int policy;
    int paced;                /* every tenant keeps to its window by itself (cgpu_engine_set_windows) */
    int pace_refused;         /* a tenant's threads waited at its paced gate: slices until the tenants change */
};

/* One tenant's accounting, for metrics; counted by cgpud's loop alone,
 * never from what the tenant writes, except that `throttled_ns` needs the
 * tenant's own `waiting` to say it has work at the closed gate. */
struct cgpu_engine_tenant_metrics {
    uint64_t charged_ns;        /* device time charged since attach (grant to fence, overdue included) */
    uint64_t throttled_ns;      /* time its threads waited at its closed gate, at the loop's granularity */
    uint64_t grants;            /* gate openings for it */
    uint64_t window_ns;         /* length of the last completed share window; 0 before the first */
    uint64_t window_charged_ns; /* device time charged in that window */
    uint64_t idle_grace_ns;     /* how long it may hold the GPU idle while another waits (learned) */
};

struct cgpu_engine;

/* NULL when gpu_count is 0 or above CGPU_SCHED_MAX_GPUS, or out of memory. */
struct cgpu_engine *cgpu_engine_create(unsigned gpu_count);
/* The caller has stopped and joined every run() first. */
void cgpu_engine_destroy(struct cgpu_engine *e);

/* Results are the cgpu_sched_status values; attach adds -errno of a failing
 * open or map, with the message in err. */
int cgpu_engine_configure(struct cgpu_engine *e, unsigned gpu, int policy, uint64_t period_ns,
                          uint64_t max_slice_ns, unsigned high_prio_percent);
/* Whether the tenants keep to their windows (cgpu/region.h, alone_*) by
 * themselves while cgpud runs, as they do while it is away: the loop then
 * hands out no slices and sleeps until a tenant or the policy changes.
 * CGPU_ENGINE_WINDOWS_FIXED: under `fixed`, each share's window.
 * CGPU_ENGINE_WINDOWS_BUSY: under `fair`, `preemptive` and `weighted`, equal
 * (weighted) windows while every tenant keeps its own busy, which is all the
 * slices would hand out then. Neither by default. */
int cgpu_engine_set_windows(struct cgpu_engine *e, unsigned gpu, int which);
/* Maps <region_dir>/grants and usage and schedules device `slot` of that
 * instance as tenant `key` on `gpu`. */
int cgpu_engine_attach(struct cgpu_engine *e, unsigned gpu, uint64_t key, const char *region_dir, unsigned slot,
                       unsigned share_percent, unsigned weight, int high_priority, char *err, unsigned errlen);
/* The tenant's gate is left closed: a released instance computes no more. */
int cgpu_engine_detach(struct cgpu_engine *e, unsigned gpu, uint64_t key);

/* Runs GPU `gpu`'s loop until cgpu_engine_stop(); returns 0, or a negative
 * status at once for a bad GPU or a second runner. */
int cgpu_engine_run(struct cgpu_engine *e, unsigned gpu);
void cgpu_engine_stop(struct cgpu_engine *e);

int cgpu_engine_stats_get(struct cgpu_engine *e, unsigned gpu, struct cgpu_engine_stats *out);
int cgpu_engine_tenant_get(struct cgpu_engine *e, unsigned gpu, uint64_t key, struct cgpu_sched_tenant_info *out);
int cgpu_engine_tenant_metrics_get(struct cgpu_engine *e, unsigned gpu, uint64_t key,
                                   struct cgpu_engine_tenant_metrics *out);
/* 1 when the tenant truncated its usage file under the engine's mapping
 * (guard.h: the engine now reads zeros there, so no demand and no live
 * process), 0 if not, or a negative status. Re-attach it once repaired. */
int cgpu_engine_tenant_damaged(struct cgpu_engine *e, unsigned gpu, uint64_t key);

#endif
