/* The compute scheduler's engine (engine.h): the decision core run against
 * the instances' grants and usage files. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cgpu/region.h"
#include "scheduler.h"
#include "engine.h"
#include "guard.h"
#include "../region/region_file.h"

struct tenant {
    uint64_t key;            /* 0: free entry */
    unsigned slot;           /* device index within the instance */
    struct cgpu_grants *grants;
    struct cgpu_usage *usage;
    int usage_fd;            /* for probing ledger locks */
    int usage_guard;         /* guard.h handle + 1 (0: none): the tenant can truncate the file under us */
    int grants_fd;           /* holds the CGPU_GRANTS_LOCK_OFFSET(slot) lock: "cgpud drives this gate" */
    int locked;              /* that lock is ours (retried by the loop until it is) */
    int overdue;             /* a closing's fence outlived the timeout: still charged, not granted */
    uint32_t overdue_seq;    /* that closing's gate word */
    uint64_t overdue_charged_to;
    uint64_t overdue_closed; /* when that closing was made */
    uint64_t overdue_probed; /* when its ledger locks were last probed */
    uint64_t overdue_dead[CGPU_MAX_PROCS / 64]; /* ledgers found dead since it became overdue */
    int launched;            /* its last fence said it had launched work */
    uint32_t stale_waiting;  /* `waiting` left behind by processes killed at the gate */
    int detach_pending;      /* detached while its fence was awaited: gone for every
                                caller, the loop unmaps it once the fence is over */
    uint64_t charged_ns;     /* metrics (cgpu_engine_tenant_metrics) */
    uint64_t throttled_ns;
    uint64_t granted;
    uint64_t win_mark;       /* charged_ns when the current window began */
    uint64_t win_charged;    /* charged in the last completed window */
    int idle_out;            /* its grant ends for idleness: that grant is no demand */
    uint64_t idle_probed[CGPU_MAX_PROCS / 64]; /* ledgers whose lock this grant's idle checks probed */
    uint64_t idle_dead[CGPU_MAX_PROCS / 64];   /* of those, the dead */
    uint32_t quiet_handovers; /* idle hand-overs in a row it did not come back from within a grace */
    uint32_t learn_after;     /* how many make its grace short (CGPU_ENGINE_GRACE_LEARN, doubling) */
    unsigned share;           /* its percentage, for the windows it keeps while cgpud is away */
    unsigned weight;          /* for its busy window under `weighted` */
    int high_priority;        /* takes the GPU first: no busy window holds that */
    int paced;                /* its gate is the grant's `paced` word: it keeps to its window */
    uint64_t fill_mark;       /* its `paced_ns` when the current busy-window weighing began */
};

struct gpu_loop {
    struct tenant t[CGPU_SCHED_MAX_TENANTS];
    uint64_t holder;         /* key whose gate is open, 0 for none */
    uint64_t charged_to;     /* the holder has been charged up to here */
    struct tenant *fencing;  /* entry whose fence is awaited with the mutex released */
    int ungated;             /* every gate says CGPU_GATE_UNGATED */
    int running;
    uint64_t last_turn;      /* when demand was last read; 0 after a wait with no time to account */
    uint64_t win_start;      /* current share window; 0 before the first */
    uint64_t win_ns;         /* length of the last completed one */
    uint32_t open_word;      /* the holder's gate word at its grant */
    uint64_t idle_since;     /* since when the holder has been seen idle, 0: not */
    uint32_t idle_bell;      /* the holder's bell then: a report since moves it */
    uint64_t quiet_key;      /* the tenant last passed over for idleness, until it is judged */
    uint64_t quiet_until;    /* back at its gate before this, it would have kept a full grace */
    _Atomic uint32_t *bell_wait; /* the holder's bell while the loop sleeps on it */
    int kicked;              /* something changed since the loop last turned */
    int policy;              /* as configured: whether shares hold while cgpud is away */
    int windows;             /* CGPU_ENGINE_WINDOWS_*: policies whose tenants may keep to windows */
    int paced;               /* every tenant does so now, and the loop sleeps until a change */
    uint64_t busy_from;      /* slices since then found every tenant with work; 0: not so at the last turn */
    int busy_misses;         /* busy windows ended for want of use since the tenants or policy changed */
    uint64_t fill_from;      /* busy windows: when the current weighing of their use began */
    int pace_strikes;        /* looks in a row that found threads waiting at a paced gate */
    int pace_refused;        /* so slices again, until the tenants or the policy change */
    uint64_t period_ns;
    pthread_cond_t wake;
    struct cgpu_engine_stats stats;
};

struct cgpu_engine {
    pthread_mutex_t mu;
    struct cgpu_sched *sched;
    unsigned gpu_count;
    int stop;
    struct gpu_loop gpu[];
};

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static struct timespec abs_timespec(uint64_t ns)
{
    return (struct timespec){.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
}

/* Shared (not private) futexes: the words live in files other processes map. */
static void futex_wake_all(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Returns 1 when the wait ran out (rather than being woken or the word moving). */
static int futex_wait_for(_Atomic uint32_t *word, uint32_t seen, uint64_t ns)
{
    struct timespec rel = abs_timespec(ns);
    return syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &rel, NULL, 0) != 0 && errno == ETIMEDOUT;
}

static _Atomic uint32_t *gate_of(const struct tenant *t)
{
    return &t->grants->device[t->slot].gate;
}

/* Every change moves the sequence on, so a process that saw the old value
 * wakes and a fence acknowledgement names exactly one closing. */
static uint32_t gate_set(struct tenant *t, uint32_t bits)
{
    _Atomic uint32_t *g = gate_of(t);
    uint32_t v = ((atomic_load(g) & CGPU_GATE_SEQ_MASK) + CGPU_GATE_SEQ_STEP) | bits;
    atomic_store(g, v);
    futex_wake_all(g);
    return v;
}

/* Asks the holder's processes to look for their own idleness (the grants
 * file's `probe`, cgpu/region.h) while another tenant waits. The gate word
 * is unchanged; the futex wake-up reaches their fence watchers, the only
 * threads asleep on an open gate. At most once per grant: a watcher keeps
 * looking until the gate changes. */
static void ask_probe(struct tenant *t, uint32_t open_word)
{
    _Atomic uint32_t *probe = &t->grants->device[t->slot].probe;
    if (atomic_load_explicit(probe, memory_order_relaxed) == open_word)
        return;
    atomic_store(probe, open_word);
    futex_wake_all(gate_of(t));
}

static struct gpu_loop *loop_at(struct cgpu_engine *e, unsigned gpu)
{
    return e && gpu < e->gpu_count ? &e->gpu[gpu] : NULL;
}

/* Caller holds the mutex. The loop sleeps on its condition variable, or on
 * the holder's bell (a futex) while it watches for idleness. */
static void wake_loop(struct gpu_loop *g)
{
    g->kicked = 1;
    pthread_cond_signal(&g->wake);
    if (g->bell_wait)
        futex_wake_all(g->bell_wait);
}

/* A detached entry still awaiting its fence is not found: its key may be
 * attached afresh as a new entry meanwhile. */
static struct tenant *find(struct gpu_loop *g, uint64_t key)
{
    for (unsigned i = 0; key && i < CGPU_SCHED_MAX_TENANTS; i++)
        if (g->t[i].key == key && !g->t[i].detach_pending)
            return &g->t[i];
    return NULL;
}

/* Takes the mutex and finds tenant `key` of `gpu` (and its loop, unless `g`
 * is NULL): 0 with the mutex held for the caller to release; else, not
 * holding it, EINVAL without an engine, ENODEV for a GPU it does not drive,
 * ENOENT for a tenant it does not know. */
static int lock_tenant(struct cgpu_engine *e, unsigned gpu, uint64_t key, struct gpu_loop **g, struct tenant **t)
{
    struct gpu_loop *loop = loop_at(e, gpu);
    if (!loop)
        return e ? CGPU_SCHED_ENODEV : CGPU_SCHED_EINVAL;
    pthread_mutex_lock(&e->mu);
    *t = find(loop, key);
    if (!*t) {
        pthread_mutex_unlock(&e->mu);
        return CGPU_SCHED_ENOENT;
    }
    if (g)
        *g = loop;
    return 0;
}

static void unmap_tenant(struct tenant *t)
{
    if (t->grants)
        munmap(t->grants, sizeof(*t->grants));
    if (t->usage_guard)
        cgpu_guard_unregister(t->usage_guard - 1);
    if (t->usage)
        munmap(t->usage, sizeof(*t->usage));
    if (t->usage_fd >= 0)
        close(t->usage_fd);
    if (t->grants_fd >= 0)
        close(t->grants_fd); /* drops the lock */
    *t = (struct tenant){.usage_fd = -1, .grants_fd = -1};
}

struct cgpu_engine *cgpu_engine_create(unsigned gpu_count)
{
    if (gpu_count == 0 || gpu_count > CGPU_SCHED_MAX_GPUS)
        return NULL;
    struct cgpu_engine *e = calloc(1, sizeof(*e) + gpu_count * sizeof(e->gpu[0]));
    if (!e)
        return NULL;
    e->sched = cgpu_sched_create(gpu_count);
    if (!e->sched) {
        free(e);
        return NULL;
    }
    e->gpu_count = gpu_count;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    for (unsigned i = 0; i < gpu_count; i++) {
        pthread_cond_init(&e->gpu[i].wake, &ca);
        for (unsigned k = 0; k < CGPU_SCHED_MAX_TENANTS; k++)
            e->gpu[i].t[k].usage_fd = e->gpu[i].t[k].grants_fd = -1;
    }
    pthread_condattr_destroy(&ca);
    return e;
}

void cgpu_engine_destroy(struct cgpu_engine *e)
{
    if (!e)
        return;
    for (unsigned i = 0; i < e->gpu_count; i++) {
        for (unsigned k = 0; k < CGPU_SCHED_MAX_TENANTS; k++)
            if (e->gpu[i].t[k].key)
                unmap_tenant(&e->gpu[i].t[k]);
        pthread_cond_destroy(&e->gpu[i].wake);
    }
    pthread_mutex_destroy(&e->mu);
    cgpu_sched_destroy(e->sched);
    free(e);
}

static int busy_policy(int policy)
{
    return policy == CGPU_SCHED_FAIR || policy == CGPU_SCHED_PREEMPTIVE || policy == CGPU_SCHED_WEIGHTED;
}

/* Busy windows: what `fair` and `preemptive` (equal) and `weighted` (by
 * weight) hand out when every tenant has work, tiled in turn. Caller holds
 * the mutex. */
static void plan_busy(struct gpu_loop *g)
{
    uint64_t p = g->period_ns, at = 0, total = 0;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++)
        if (g->t[i].key && !g->t[i].detach_pending)
            total += g->policy == CGPU_SCHED_WEIGHTED ? g->t[i].weight : 1;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        if (!t->key || !t->grants)
            continue;
        uint64_t len = 0;
        if (!t->detach_pending && total)
            len = p * (g->policy == CGPU_SCHED_WEIGHTED ? t->weight : 1) / total; /* p <= 2^30, weight <= 100 */
        struct cgpu_device_grant *d = &t->grants->device[t->slot];
        atomic_store(&d->alone_start_ns, len ? at : 0);
        atomic_store(&d->alone_len_ns, len);
        atomic_store(&d->alone_period_ns, len ? p : 0);
        at += len;
    }
}

/* The windows each tenant keeps to while cgpud is away (cgpu/region.h,
 * alone_*): under `fixed`, every share tiles its part of the period in
 * turn and the memory-only tenants share what is left, so tenants that
 * pace themselves without talking to each other never overlap. Other
 * policies lend and borrow, which takes an arbiter: no window (fail open),
 * except while busy windows last, which are what the arbiter would do.
 * Caller holds the mutex. */
static void plan_alone(struct gpu_loop *g)
{
    if (g->paced && busy_policy(g->policy)) {
        plan_busy(g);
        return;
    }
    uint64_t p = g->period_ns, at = 0;
    unsigned total = 0;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++)
        total += g->t[i].key && !g->t[i].detach_pending ? g->t[i].share : 0;
    int plan = g->policy == CGPU_SCHED_FIXED && p && total <= 100;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t rest = p > at ? p - at : 0, rest_at = at;
        for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
            struct tenant *t = &g->t[i];
            if (!t->key || !t->grants || (pass == 0) != (t->share > 0))
                continue;
            uint64_t start = 0, len = 0;
            if (plan && t->share && !t->detach_pending) {
                start = at;
                len = p / 100 * t->share;
                at += len;
            } else if (plan && !t->detach_pending) {
                start = rest_at;
                len = rest;
            }
            struct cgpu_device_grant *d = &t->grants->device[t->slot];
            atomic_store(&d->alone_start_ns, start);
            atomic_store(&d->alone_len_ns, len);
            atomic_store(&d->alone_period_ns, len ? p : 0);
        }
    }
}

/* Whether every tenant can keep to its own window with nobody handing out
 * slices: windows asked for under this policy, each tenant with a window,
 * cgpud's lock held (so they know cgpud still runs) and no fence
 * outstanding. A fixed schedule lends nothing, so the windows are all it
 * would do. Under the busy policies, the same holds while every tenant has
 * work all the time: the slices must have shown that for
 * CGPU_ENGINE_BUSY_PROOF_NS (a tenant's own `waiting` and launches, read by
 * the loop), and it stays so until a tenant leaves its windows idle, a
 * tenant comes or goes, or the policy changes; nobody takes the GPU first,
 * and there are two tenants at least. */
static int paceable(const struct gpu_loop *g, uint64_t now)
{
    int busy = busy_policy(g->policy);
    if (g->pace_refused || !(g->windows & (busy ? CGPU_ENGINE_WINDOWS_BUSY : CGPU_ENGINE_WINDOWS_FIXED)))
        return 0;
    if (!busy && g->policy != CGPU_SCHED_FIXED)
        return 0;
    if (busy) {
        int doublings = g->busy_misses < CGPU_ENGINE_BUSY_BACKOFF_MAX ? g->busy_misses : CGPU_ENGINE_BUSY_BACKOFF_MAX;
        uint64_t proof = (uint64_t)CGPU_ENGINE_BUSY_PROOF_NS << doublings;
        if (!(g->period_ns && g->busy_from && (g->paced || now - g->busy_from >= proof)))
            return 0;
    }
    int n = 0;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        const struct tenant *t = &g->t[i];
        if (!t->key || t->detach_pending)
            continue;
        if (!t->grants || !t->locked || t->overdue || (busy && t->high_priority) ||
            (!busy && !atomic_load(&t->grants->device[t->slot].alone_period_ns)))
            return 0;
        n++;
    }
    /* A lone busy tenant already holds the GPU with no fences between
     * slices; a window of the whole period would drain its queue at each
     * period's end for nothing. */
    return busy ? n > 1 : n > 0;
}

/* Closes each tenant's gate on a word that its grant's `paced` names first,
 * so that its processes pace themselves in their windows from the change
 * on. Caller holds the mutex; no tenant holds the GPU. */
static void pace_all(struct gpu_loop *g, uint64_t now)
{
    if (!g->paced && busy_policy(g->policy)) {
        g->paced = 1; /* plan_alone then plans busy windows */
        plan_alone(g);
        g->fill_from = now;
    }
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        if (!t->key || t->detach_pending || t->paced)
            continue;
        _Atomic uint32_t *w = gate_of(t);
        uint32_t v = (atomic_load(w) & CGPU_GATE_SEQ_MASK) + CGPU_GATE_SEQ_STEP;
        if (!v) /* 0 means "not paced" */
            v = CGPU_GATE_SEQ_STEP;
        atomic_store(&t->grants->device[t->slot].paced, v);
        atomic_store(w, v);
        futex_wake_all(w);
        t->paced = 1;
        t->fill_mark = atomic_load(&t->usage->device[t->slot].paced_ns);
    }
    g->ungated = 0;
    g->paced = 1;
}

/* Whether a paced tenant has threads waiting at its gate: its processes do
 * not pace themselves (a libcgpu older than pacing), or it says so in its
 * own usage file, which costs it nothing but cgpud's CPU. */
static int waiting_at_paced_gate(const struct gpu_loop *g)
{
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        const struct tenant *t = &g->t[i];
        if (t->key && t->paced && atomic_load(&t->usage->device[t->slot].waiting) > t->stale_waiting)
            return 1;
    }
    return 0;
}

/* Whether each paced tenant used its busy windows over the weighing that
 * ends now: its processes' own measure of their paced device time
 * (tenant-written). One that says it idled brings the slices back; one that
 * lies keeps windows it leaves idle, which its own busy kernels could do as
 * well: what it can cost the others is the loan of its own window. Starts
 * the next weighing. */
static int busy_windows_used(struct gpu_loop *g, uint64_t now)
{
    /* Bounded so the arithmetic below cannot wrap (a loop stalled for hours). */
    const uint64_t cap = 1000ull * CGPU_ENGINE_BUSY_FILL_NS;
    uint64_t elapsed = now - g->fill_from < cap ? now - g->fill_from : cap;
    int used = 1;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        if (!t->key || !t->paced)
            continue;
        uint64_t ns = atomic_load(&t->usage->device[t->slot].paced_ns);
        uint64_t len = atomic_load(&t->grants->device[t->slot].alone_len_ns);
        uint64_t took = ns >= t->fill_mark ? ns - t->fill_mark : 0;
        /* elapsed / 1000 < 2^31 and len <= period < 2^30 (scheduler.h): no
         * overflow. Measured at each drain of the queue, so up to a window
         * lags behind. */
        uint64_t owed = elapsed / 1000 * len / g->period_ns * CGPU_ENGINE_BUSY_FILL_PERCENT / 100 * 1000;
        if (took + len < owed)
            used = 0;
        t->fill_mark = ns;
    }
    g->fill_from = now;
    return used;
}

/* A change of tenants or policy: pacing may be tried again; busy windows
 * only after the slices have shown every tenant busy again. */
static void pace_again(struct gpu_loop *g)
{
    g->pace_refused = 0;
    g->pace_strikes = 0;
    g->busy_from = 0;
    g->busy_misses = 0;
}

/* Back to slices: a new closed word ends every tenant's pacing. */
static void unpace_all(struct gpu_loop *g)
{
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        if (!t->key || !t->paced)
            continue;
        atomic_store(&t->grants->device[t->slot].paced, 0);
        gate_set(t, 0);
        t->paced = 0;
    }
    g->paced = 0;
    plan_alone(g); /* busy windows end with the pacing: away, those tenants fail open */
}

int cgpu_engine_set_windows(struct cgpu_engine *e, unsigned gpu, int which)
{
    struct gpu_loop *g = loop_at(e, gpu);
    if (!g)
        return e ? CGPU_SCHED_ENODEV : CGPU_SCHED_EINVAL;
    if (which & ~(CGPU_ENGINE_WINDOWS_FIXED | CGPU_ENGINE_WINDOWS_BUSY))
        return CGPU_SCHED_EINVAL;
    pthread_mutex_lock(&e->mu);
    g->windows = which;
    pace_again(g);
    wake_loop(g);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

int cgpu_engine_configure(struct cgpu_engine *e, unsigned gpu, int policy, uint64_t period_ns,
                          uint64_t max_slice_ns, unsigned high_prio_percent)
{
    struct gpu_loop *g = loop_at(e, gpu);
    if (!g)
        return e ? CGPU_SCHED_ENODEV : CGPU_SCHED_EINVAL;
    pthread_mutex_lock(&e->mu);
    int rc = cgpu_sched_configure(e->sched, gpu, policy, period_ns, max_slice_ns, high_prio_percent);
    if (rc == 0) {
        g->policy = policy;
        g->period_ns = period_ns;
        pace_again(g);
        plan_alone(g);
        wake_loop(g);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* A tenant's grants or usage file, read-write, never through a link; and
 * only a regular file: the check region_file.c leaves out for libcgpu's
 * sake (fstat). */
static void *map_region_file(const char *dir, const char *name, size_t size, int *fd_out, char *err, unsigned errlen,
                             int *rc)
{
    struct cgpu_region_file f;
    *rc = cgpu_region_file_map(dir, name, O_RDWR | O_NOFOLLOW, size, &f, err, errlen);
    if (*rc != 0)
        return NULL;
    struct stat sb;
    if (fstat(f.fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        *rc = CGPU_SCHED_EINVAL;
        snprintf(err, errlen, "%s/%s is not a cgpu region file of %zu bytes", dir, name, size);
        munmap(f.addr, f.size);
        close(f.fd);
        return NULL;
    }
    *fd_out = f.fd;
    return f.addr;
}

/* Tells the tenant's processes that cgpud drives this gate. Fails only
 * while another descriptor still holds it (this slot re-attached while its
 * old entry's fence is awaited, or a second cgpud): the loop tries again. */
static int take_gate_lock(const struct tenant *t)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = CGPU_GRANTS_LOCK_OFFSET(t->slot),
                       .l_len = 1};
    return fcntl(t->grants_fd, F_OFD_SETLK, &fl) == 0;
}

int cgpu_engine_attach(struct cgpu_engine *e, unsigned gpu, uint64_t key, const char *region_dir, unsigned slot,
                       unsigned share_percent, unsigned weight, int high_priority, char *err, unsigned errlen)
{
    struct gpu_loop *g = loop_at(e, gpu);
    if (!g)
        return e ? CGPU_SCHED_ENODEV : CGPU_SCHED_EINVAL;
    if (!key || !region_dir || !err || errlen == 0 || slot >= CGPU_MAX_DEVICES)
        return CGPU_SCHED_EINVAL;
    err[0] = '\0';
    pthread_mutex_lock(&e->mu);
    struct tenant *t = find(g, key);
    int rc = 0;
    if (t) { /* a new share, weight or priority for a known tenant */
        rc = t->slot == slot ? cgpu_sched_tenant_set(e->sched, gpu, key, share_percent, weight, high_priority)
                             : CGPU_SCHED_EINVAL;
        if (rc == 0) {
            t->share = share_percent;
            t->weight = weight;
            t->high_priority = high_priority;
            plan_alone(g);
            wake_loop(g); /* a tenant that takes the GPU first ends busy windows */
        }
        goto out;
    }
    for (unsigned i = 0; !t && i < CGPU_SCHED_MAX_TENANTS; i++)
        if (!g->t[i].key)
            t = &g->t[i];
    if (!t) {
        rc = CGPU_SCHED_ENOSPC;
        goto out;
    }
    struct tenant fresh = {
        .key = key, .slot = slot, .usage_fd = -1, .grants_fd = -1, .learn_after = CGPU_ENGINE_GRACE_LEARN};
    fresh.grants =
        map_region_file(region_dir, CGPU_GRANTS_FILE, sizeof(struct cgpu_grants), &fresh.grants_fd, err, errlen, &rc);
    if (fresh.grants)
        fresh.usage =
            map_region_file(region_dir, CGPU_USAGE_FILE, sizeof(struct cgpu_usage), &fresh.usage_fd, err, errlen, &rc);
    /* Guarded before the first read: a truncated file then reads as zeros,
     * which the loop takes as no demand and no live process. */
    if (fresh.usage) {
        fresh.usage_guard = cgpu_guard_register(fresh.usage, sizeof(struct cgpu_usage)) + 1;
        if (!fresh.usage_guard) {
            rc = CGPU_SCHED_ENOSPC;
            snprintf(err, errlen, "no room to guard %s/%s against truncation", region_dir, CGPU_USAGE_FILE);
        }
    }
    if (rc == 0 && fresh.grants && fresh.usage &&
        (fresh.grants->magic != CGPU_GRANTS_MAGIC || fresh.usage->magic != CGPU_USAGE_MAGIC)) {
        rc = CGPU_SCHED_EINVAL;
        snprintf(err, errlen, "%s holds no cgpu grants and usage files of this version", region_dir);
    }
    if (rc == 0)
        rc = cgpu_sched_tenant_set(e->sched, gpu, key, share_percent, weight, high_priority);
    if (rc != 0) {
        unmap_tenant(&fresh);
        goto out;
    }
    *t = fresh;
    t->share = share_percent;
    t->weight = weight;
    t->high_priority = high_priority;
    pace_again(g);
    plan_alone(g);
    t->locked = take_gate_lock(t);
    /* Closed until the loop grants it, or open if the GPU is ungated. */
    gate_set(t, g->ungated ? CGPU_GATE_UNGATED : 0);
    wake_loop(g);
out:
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* Caller holds the mutex. */
static void forget(struct cgpu_engine *e, unsigned gpu, struct tenant *t)
{
    struct gpu_loop *g = &e->gpu[gpu];
    atomic_store(&t->grants->device[t->slot].paced, 0);
    gate_set(t, 0);
    cgpu_sched_tenant_remove(e->sched, gpu, t->key);
    if (g->holder == t->key)
        g->holder = 0;
    unmap_tenant(t);
}

int cgpu_engine_detach(struct cgpu_engine *e, unsigned gpu, uint64_t key)
{
    struct gpu_loop *g;
    struct tenant *t;
    int rc = lock_tenant(e, gpu, key, &g, &t);
    if (rc)
        return rc;
    if (g->fencing == t) {
        t->detach_pending = 1; /* the loop reads its files right now; it finishes this */
        if (g->bell_wait)
            gate_set(t, 0); /* it only sleeps on the holder's bell: close now, as forget would */
    } else {
        forget(e, gpu, t);
    }
    cgpu_sched_tenant_remove(e->sched, gpu, key);
    if (g->quiet_key == key)
        g->quiet_key = 0;
    pace_again(g);
    plan_alone(g);
    wake_loop(g);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

void cgpu_engine_stop(struct cgpu_engine *e)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    for (unsigned i = 0; i < e->gpu_count; i++)
        wake_loop(&e->gpu[i]);
    pthread_mutex_unlock(&e->mu);
}

/* True when no process holds ledger i's lock any more: it died without
 * acknowledging, and has nothing left in flight. */
static int ledger_dead(int fd, int i)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = CGPU_LEDGER_LOCK_OFFSET(i), .l_len = 1};
    return fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK;
}

/* Whether a fence acknowledgement covers the closing `closed`: it names
 * that closing or a later one (sequence arithmetic, so wrapping is fine). */
static int ack_covers(uint32_t ack, uint32_t closed)
{
    return (int32_t)((ack & CGPU_GATE_SEQ_MASK) - (closed & CGPU_GATE_SEQ_MASK)) >= 0;
}

/* Live processes that launch on the tenant's device and have not fenced
 * `closed`. Every field read here is the tenant's to scribble on: indices
 * are bounded, and a ledger whose lock probe (only with `probe`) found it
 * dead is marked in `dead` and never probed again for this closing, so a
 * scribbled table costs at most one probe per ledger. */
static int fence_pending(const struct tenant *t, uint32_t closed, int probe, uint64_t *dead, int *launched)
{
    struct cgpu_usage *u = t->usage;
    uint32_t bit = 1u << t->slot;
    uint32_t n = atomic_load(&u->ledgers_used);
    int pending = 0;
    for (uint32_t i = 0; i < n && i < CGPU_MAX_PROCS; i++) {
        struct cgpu_proc_ledger *p = &u->proc[i];
        if (dead[i / 64] & (1ull << (i % 64)))
            continue;
        if (atomic_load(&p->state) != CGPU_LEDGER_LIVE || !(atomic_load(&p->watching) & bit))
            continue;
        uint32_t ack = atomic_load_explicit(&p->fence_ack[t->slot], memory_order_acquire);
        if (ack_covers(ack, closed)) {
            *launched |= (ack & CGPU_ACK_LAUNCHED) != 0;
            continue;
        }
        if (probe && ledger_dead(t->usage_fd, (int)i)) {
            dead[i / 64] |= 1ull << (i % 64);
            continue;
        }
        pending++;
    }
    return pending;
}

#define DEAD_WORDS (CGPU_MAX_PROCS / 64)

/* Waits, without the mutex, until every live process that launches on the
 * tenant's device has acknowledged the closing `closed`. Returns 1 if all
 * did, 0 on timeout; *launched tells whether any had launched work, and
 * `dead` (DEAD_WORDS, zeroed by the caller) the ledgers found dead. The
 * files stay mapped: detach defers to the loop while `fencing` names us. */
static int await_fence(const struct tenant *t, uint32_t closed, int *launched, uint64_t *dead)
{
    _Atomic uint32_t *bell = &t->usage->device[t->slot].bell;
    uint64_t deadline = mono_ns() + CGPU_ENGINE_FENCE_TIMEOUT_NS;
    for (int probe = 0;;) {
        uint32_t rung = atomic_load(bell);
        /* A lock probe costs a syscall: only once a wait ran out. */
        if (!fence_pending(t, closed, probe, dead, launched))
            return 1;
        uint64_t now = mono_ns();
        if (now >= deadline)
            return 0;
        /* Acknowledgements ring the bell, so the wait ends early only for a
         * process that died without one; a fence drains up to a few ms of
         * queued work, and waking before it is done costs a hand-over two
         * futex calls and a probe per process for nothing. */
        uint64_t left = deadline - now;
        probe = futex_wait_for(bell, rung, left < CGPU_ENGINE_FENCE_PROBE_NS ? left : CGPU_ENGINE_FENCE_PROBE_NS);
    }
}

/* Whether any process of the tenant that launches on its device still lives. */
static int has_live_watcher(const struct tenant *t)
{
    const struct cgpu_usage *u = t->usage;
    uint32_t n = atomic_load(&u->ledgers_used);
    for (uint32_t i = 0; i < n && i < CGPU_MAX_PROCS; i++) {
        const struct cgpu_proc_ledger *p = &u->proc[i];
        if (atomic_load(&p->state) == CGPU_LEDGER_LIVE && (atomic_load(&p->watching) & (1u << t->slot)) &&
            !ledger_dead(t->usage_fd, (int)i))
            return 1;
    }
    return 0;
}

static void charge_holder(struct cgpu_engine *e, unsigned gpu, uint64_t now)
{
    struct gpu_loop *g = &e->gpu[gpu];
    if (g->holder && now > g->charged_to) {
        cgpu_sched_charge(e->sched, gpu, g->holder, now - g->charged_to);
        struct tenant *h = find(g, g->holder);
        if (h)
            h->charged_ns += now - g->charged_to;
    }
    g->charged_to = now;
}

static int reports_drained(const struct tenant *t, uint32_t open_word);
static int tenant_count(const struct gpu_loop *g);

/* Closes the holder's gate and charges it until its processes have fenced.
 * Caller holds the mutex; it is released while waiting. */
static void close_holder(struct cgpu_engine *e, unsigned gpu)
{
    struct gpu_loop *g = &e->gpu[gpu];
    struct tenant *t = find(g, g->holder);
    if (!t) {
        g->holder = 0;
        return;
    }
    uint32_t closed = gate_set(t, 0);
    uint64_t start = mono_ns();
    if (t->idle_out && reports_drained(t, g->open_word)) {
        charge_holder(e, gpu, start);
        g->holder = 0;
        g->stats.fences++;
        t->launched = 0;
        t->idle_out = 0;
        return;
    }
    g->fencing = t;
    pthread_mutex_unlock(&e->mu);
    int launched = 0;
    uint64_t dead[DEAD_WORDS] = {0};
    int acked = await_fence(t, closed, &launched, dead);
    pthread_mutex_lock(&e->mu);
    g->fencing = NULL;
    uint64_t end = mono_ns();
    if (t->detach_pending)
        g->holder = 0; /* nobody to charge: the key may name a new tenant by now */
    charge_holder(e, gpu, end);
    g->holder = 0;
    g->stats.fence_wait_ns += end - start;
    if (acked) {
        g->stats.fences++;
    } else {
        /* Its work (a kernel longer than the timeout, or a process that does
         * not fence) may run on into the next slice: the loop goes on, and
         * charges it until the fence really arrives. */
        g->stats.fence_timeouts++;
        t->overdue = !t->detach_pending;
        t->overdue_seq = closed;
        t->overdue_charged_to = t->overdue_probed = end;
        t->overdue_closed = start;
        memcpy(t->overdue_dead, dead, sizeof(dead));
    }
    /* Passed over for idleness: what it launched in the grant is done. */
    t->launched = launched && !t->idle_out;
    t->idle_out = 0;
    /* Granted, nothing launched, yet threads "wait": if no process that
     * could be waiting is alive, the count is what killed waiters left
     * (they cannot take themselves off it). It no longer means demand. */
    uint32_t waiting = atomic_load(&t->usage->device[t->slot].waiting);
    if (!launched && waiting > t->stale_waiting && !t->detach_pending && !has_live_watcher(t))
        t->stale_waiting = waiting;
    if (t->detach_pending)
        unmap_tenant(t); /* its gate is closed, and detach took it off the core */
}

static void set_all_gates(struct gpu_loop *g, uint32_t bits)
{
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        if (g->t[i].key)
            gate_set(&g->t[i], bits);
        if (bits & CGPU_GATE_UNGATED)
            g->t[i].overdue = 0; /* no control: nothing left to charge */
    }
}

/* Whether a tenant's fence is overdue by less than CGPU_ENGINE_OVERDUE_HOLD_NS
 * since its closing: the GPU is still its own, busy with its long kernel. */
static int overdue_holds_gpu(const struct gpu_loop *g, uint64_t now)
{
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        const struct tenant *t = &g->t[i];
        if (t->key && t->overdue && !t->detach_pending && now - t->overdue_closed < CGPU_ENGINE_OVERDUE_HOLD_NS)
            return 1;
    }
    return 0;
}

/* Charges each tenant whose fence outlived the timeout for the time since it
 * was last charged, and ends that once its processes have fenced (or died).
 * Until then it holds the device in all but name: it is not granted. */
static void charge_overdue(struct cgpu_engine *e, unsigned gpu, uint64_t now)
{
    struct gpu_loop *g = &e->gpu[gpu];
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        if (!t->key || !t->overdue || t->detach_pending)
            continue;
        if (now > t->overdue_charged_to) {
            cgpu_sched_charge(e->sched, gpu, t->key, now - t->overdue_charged_to);
            t->charged_ns += now - t->overdue_charged_to;
        }
        t->overdue_charged_to = now;
        /* Lock probes as often as a fence wait makes them, however often
         * the loop turns: a tenant with many unacknowledging processes
         * must not turn cgpud's thread into a probing loop. */
        int probe = now - t->overdue_probed >= CGPU_ENGINE_FENCE_PROBE_NS;
        if (probe)
            t->overdue_probed = now;
        int launched = 0;
        if (!fence_pending(t, t->overdue_seq, probe, t->overdue_dead, &launched)) {
            t->overdue = 0;
            t->launched |= launched;
            g->stats.fences_late++;
        }
    }
}

/* Ends the share window once it is CGPU_ENGINE_SHARE_WINDOW_NS old. */
static void turn_window(struct gpu_loop *g, uint64_t now)
{
    if (g->win_start && now - g->win_start < CGPU_ENGINE_SHARE_WINDOW_NS)
        return;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        t->win_charged = g->win_start ? t->charged_ns - t->win_mark : 0;
        t->win_mark = t->charged_ns;
    }
    g->win_ns = g->win_start ? now - g->win_start : 0;
    g->win_start = now;
}

/* Reports each tenant's demand to the core; returns how many have none.
 * A tenant with threads at its closed gate was throttled since the last
 * turn (the loop turns at least once a slice). */
static int report_demand(struct cgpu_engine *e, unsigned gpu, uint64_t now)
{
    struct gpu_loop *g = &e->gpu[gpu];
    int idle = 0;
    /* Each `waiting` is on another tenant's page, written from other CPUs:
     * a cache (and often TLB) miss apiece. Read back to back, with nothing
     * between them that depends on them, the misses overlap instead of
     * adding up one per tenant (they were the loop's dearest instructions). */
    uint32_t seen[CGPU_SCHED_MAX_TENANTS];
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++)
        seen[i] = g->t[i].key ? atomic_load(&g->t[i].usage->device[g->t[i].slot].waiting) : 0;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        if (!t->key)
            continue;
        uint32_t waiting = seen[i];
        if (waiting < t->stale_waiting)
            t->stale_waiting = waiting;
        if (!t->locked)
            t->locked = take_gate_lock(t);
        int has = !t->overdue &&
                  ((t->key == g->holder && !t->idle_out) || t->launched || waiting > t->stale_waiting);
        if (waiting > t->stale_waiting && t->key != g->holder && g->last_turn && now > g->last_turn)
            t->throttled_ns += now - g->last_turn;
        t->launched = 0;
        cgpu_sched_demand(e->sched, gpu, t->key, has, now);
        idle += !has;
    }
    g->last_turn = now;
    return idle;
}


/* Whether the holder has nothing to do: nobody waits at its gate, and every
 * live process that launches on its device reports the open grant idle.
 * The ledgers are the tenant's to scribble on: each is probed for a dead
 * owner at most once per grant. */
static int holder_idle(struct tenant *t, uint32_t open_word)
{
    struct cgpu_usage *u = t->usage;
    if (atomic_load(&u->device[t->slot].waiting) > t->stale_waiting)
        return 0;
    uint32_t want = (open_word & CGPU_GATE_SEQ_MASK) | CGPU_ACK_IDLE, bit = 1u << t->slot;
    const uint32_t report = CGPU_GATE_SEQ_MASK | CGPU_ACK_IDLE; /* drained or not */
    uint32_t n = atomic_load(&u->ledgers_used);
    /* Without a single report the answer is "busy" whoever is dead, so no
     * lock is probed: a busy holder (the common case, at every grant) costs
     * no syscall here. */
    int any = 0;
    for (uint32_t i = 0; i < n && i < CGPU_MAX_PROCS && !any; i++) {
        struct cgpu_proc_ledger *p = &u->proc[i];
        any = !(t->idle_dead[i / 64] & (1ull << (i % 64))) && atomic_load(&p->state) == CGPU_LEDGER_LIVE &&
              (atomic_load(&p->watching) & bit) && (atomic_load(&p->fence_ack[t->slot]) & report) == want;
    }
    if (!any)
        return 0;
    int reported = 0;
    for (uint32_t i = 0; i < n && i < CGPU_MAX_PROCS; i++) {
        struct cgpu_proc_ledger *p = &u->proc[i];
        uint64_t mask = 1ull << (i % 64);
        if ((t->idle_dead[i / 64] & mask) || atomic_load(&p->state) != CGPU_LEDGER_LIVE ||
            !(atomic_load(&p->watching) & bit))
            continue;
        if ((atomic_load(&p->fence_ack[t->slot]) & report) == want) {
            reported = 1;
            continue;
        }
        if (t->idle_probed[i / 64] & mask)
            return 0;
        t->idle_probed[i / 64] |= mask;
        if (!ledger_dead(t->usage_fd, (int)i))
            return 0;
        t->idle_dead[i / 64] |= mask;
    }
    /* Not idle for want of processes: one whose ledger is gone (its file
     * scribbled) may still be launching, and a grant ended at once would
     * let its queue run on uncharged, grant after grant. */
    return reported;
}

/* After the closing of an idle holder's gate: whether every live process of
 * it still reports the grant idle with its queue drained. A launch withdraws
 * its process's report before it reads the gate, so none can have passed the
 * gate since, and there is nothing left to fence. */
static int reports_drained(const struct tenant *t, uint32_t open_word)
{
    const struct cgpu_usage *u = t->usage;
    uint32_t want = (open_word & CGPU_GATE_SEQ_MASK) | CGPU_ACK_IDLE | CGPU_ACK_DRAINED, bit = 1u << t->slot;
    uint32_t n = atomic_load(&u->ledgers_used);
    int reported = 0;
    for (uint32_t i = 0; i < n && i < CGPU_MAX_PROCS; i++) {
        const struct cgpu_proc_ledger *p = &u->proc[i];
        if ((t->idle_dead[i / 64] & (1ull << (i % 64))) || atomic_load(&p->state) != CGPU_LEDGER_LIVE ||
            !(atomic_load(&p->watching) & bit))
            continue;
        if (atomic_load(&p->fence_ack[t->slot]) != want)
            return 0;
        reported = 1;
    }
    return reported;
}

/* Whether a tenant other than the holder has threads at its closed gate. */
static int others_waiting(const struct gpu_loop *g, const struct tenant *holder)
{
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        const struct tenant *t = &g->t[i];
        if (t != holder && t->key && !t->detach_pending && !t->overdue &&
            atomic_load(&t->usage->device[t->slot].waiting) > t->stale_waiting)
            return 1;
    }
    return 0;
}

static uint64_t idle_grace(const struct tenant *t)
{
    return t->quiet_handovers >= t->learn_after ? CGPU_ENGINE_IDLE_GRACE_SHORT_NS : CGPU_ENGINE_IDLE_GRACE_NS;
}

/* Judges the tenant last passed over for idleness once a full grace has gone
 * by since, or at once when `granted_key` names it (then it came back) or
 * `now_or_never` is set: back at its gate by then, a full grace would have
 * kept it on the GPU. Only its own threads' count at its own gate decides,
 * so a tenant can lengthen its own grace to the full one, never shorten
 * anyone else's. */
static void judge_quiet(struct gpu_loop *g, uint64_t now, uint64_t granted_key, int now_or_never)
{
    if (!g->quiet_key || (now < g->quiet_until && granted_key != g->quiet_key && !now_or_never))
        return;
    struct tenant *t = find(g, g->quiet_key);
    g->quiet_key = 0;
    if (!t)
        return;
    if (granted_key == t->key || atomic_load(&t->usage->device[t->slot].waiting) > t->stale_waiting) {
        if (t->quiet_handovers >= t->learn_after && t->learn_after < CGPU_ENGINE_GRACE_LEARN_MAX)
            t->learn_after *= 2;
        t->quiet_handovers = 0;
    } else if (t->quiet_handovers < UINT32_MAX) {
        t->quiet_handovers++;
    }
}

/* Sleeps, with the mutex released, until `until`, or a change (wake_loop), or
 * until the holder has stayed idle for its grace (idle_grace) while another
 * tenant waits: then returns 1. Every idle report bumps the holder's bell, so
 * "idle at two looks and the bell unmoved between them" means idle all along.
 * Reports ring the bell (wake the loop) at most once a ms per process, and a
 * look that finds the holder busy after a ring is followed by a plain sleep
 * of CGPU_ENGINE_IDLE_RECHECK_NS: a tenant that synchronises often cannot
 * keep this thread busy. While the holder is idle and nobody waits, it looks
 * for a waiter every CGPU_ENGINE_IDLE_WATCH_NS, backing off. Caller holds
 * the mutex. */
static int hold_while_busy(struct cgpu_engine *e, struct gpu_loop *g, struct tenant *t, uint64_t until)
{
    _Atomic uint32_t *bell = &t->usage->device[t->slot].bell;
    uint64_t watch = CGPU_ENGINE_IDLE_WATCH_NS;
    int rang = 0; /* the first look, at the grant, finds its threads still at the gate */
    for (;;) {
        uint64_t now = mono_ns();
        judge_quiet(g, now, 0, 0);
        if (e->stop || g->kicked || t->detach_pending || now >= until)
            return 0;
        uint32_t ring = atomic_load(bell);
        uint64_t wake = until;
        int listen = 0; /* to the bell */
        if (holder_idle(t, g->open_word)) {
            if (!g->idle_since || ring != g->idle_bell) {
                g->idle_since = now;
                g->idle_bell = ring;
            }
            if (others_waiting(g, t)) {
                uint64_t grace = idle_grace(t);
                if (now - g->idle_since >= grace)
                    return 1;
                wake = g->idle_since + grace;
            } else if (tenant_count(g) > 1) { /* a newcomer wakes the loop itself */
                wake = now + watch;
                watch = watch * 2 < CGPU_ENGINE_IDLE_POLL_NS ? watch * 2 : CGPU_ENGINE_IDLE_POLL_NS;
            } else {
                listen = 1;
            }
        } else {
            g->idle_since = 0;
            watch = CGPU_ENGINE_IDLE_WATCH_NS;
            if (others_waiting(g, t))
                ask_probe(t, g->open_word);
            if (rang)
                wake = now + CGPU_ENGINE_IDLE_RECHECK_NS;
            else
                listen = 1;
        }
        if (wake > until)
            wake = until;
        if (g->quiet_key && g->quiet_until < wake)
            wake = g->quiet_until; /* the judgement wants its moment, not the next slice's */
        if (!listen) {
            struct timespec ts = abs_timespec(wake);
            pthread_cond_timedwait(&g->wake, &e->mu, &ts);
            rang = 0;
            continue;
        }
        /* The files stay mapped while `fencing` names the holder: detach
         * leaves them to the loop. */
        g->fencing = t;
        g->bell_wait = bell;
        pthread_mutex_unlock(&e->mu);
        futex_wait_for(bell, ring, wake - now);
        pthread_mutex_lock(&e->mu);
        g->bell_wait = NULL;
        g->fencing = NULL;
        rang = !t->detach_pending && atomic_load(bell) != ring;
    }
}

static int tenant_count(const struct gpu_loop *g)
{
    int n = 0;
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++)
        n += g->t[i].key != 0 && !g->t[i].detach_pending;
    return n;
}

int cgpu_engine_run(struct cgpu_engine *e, unsigned gpu)
{
    struct gpu_loop *g = loop_at(e, gpu);
    if (!g)
        return e ? CGPU_SCHED_ENODEV : CGPU_SCHED_EINVAL;
    pthread_mutex_lock(&e->mu);
    if (g->running) {
        pthread_mutex_unlock(&e->mu);
        return CGPU_SCHED_EINVAL;
    }
    g->running = 1;
    char name[16];
    snprintf(name, sizeof(name), "cgpu-sched-%u", gpu % 100);
    pthread_setname_np(pthread_self(), name); /* so top -H and benchmarks can tell it apart */
    /* This thread's timed waits are the idle grace (0.1 ms) and slice ends:
     * the default 50 us of timer slack would add up to half a grace to every
     * hand-over and blur every slice. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    while (!e->stop) {
        g->kicked = 0;
        uint64_t now = mono_ns();
        charge_holder(e, gpu, now);
        charge_overdue(e, gpu, now);
        turn_window(g, now);
        int idle = report_demand(e, gpu, now);
        if (!g->paced) /* paced tenants wait at no gate: only slices show who has work */
            g->busy_from = idle ? 0 : g->busy_from ? g->busy_from : now;
        if (paceable(g, now)) {
            if (g->holder) {
                close_holder(e, gpu);
                continue;
            }
            pace_all(g, now);
            g->last_turn = 0; /* nobody waits at a gate meanwhile */
            struct timespec ts = abs_timespec(mono_ns() + CGPU_ENGINE_PACED_LOOK_NS);
            if (pthread_cond_timedwait(&g->wake, &e->mu, &ts) == ETIMEDOUT && !g->kicked) {
                g->pace_strikes = waiting_at_paced_gate(g) ? g->pace_strikes + 1 : 0;
                if (g->pace_strikes >= 2)
                    g->pace_refused = 1;
                uint64_t at = mono_ns();
                if (busy_policy(g->policy) && at - g->fill_from >= CGPU_ENGINE_BUSY_FILL_NS &&
                    !busy_windows_used(g, at)) {
                    g->busy_from = 0;
                    g->busy_misses++;
                    g->stats.busy_ended++;
                }
            }
            continue;
        }
        if (g->paced)
            unpace_all(g);
        struct cgpu_sched_decision d;
        int rc = cgpu_sched_next(e->sched, gpu, now, &d);
        g->stats.decisions++;
        if (rc == CGPU_SCHED_UNGATED) {
            g->holder = 0;
            if (!g->ungated)
                set_all_gates(g, CGPU_GATE_UNGATED);
            g->ungated = 1;
            g->last_turn = 0; /* nobody waits at an open gate */
            pthread_cond_wait(&g->wake, &e->mu);
            continue;
        }
        if (g->ungated) {
            set_all_gates(g, 0);
            g->ungated = 0;
        }
        if (g->holder && d.key != g->holder) {
            close_holder(e, gpu);
            continue; /* time has passed: decide afresh */
        }
        struct tenant *t = d.key != g->holder ? find(g, d.key) : NULL;
        int held = t && overdue_holds_gpu(g, now);
        if (held) {
            t = NULL; /* its kernel still runs: a grant now would be charged for time it cannot use */
            d = (struct cgpu_sched_decision){0};
        }
        judge_quiet(g, now, t ? t->key : 0, 0);
        if (t) {
            atomic_store(&t->grants->device[t->slot].slice_end_ns, now + d.slice_ns);
            /* Set before the gate opens, so the watchers the opening wakes
             * see it: no second wake-up in the common case. */
            uint32_t opening = ((atomic_load(gate_of(t)) & CGPU_GATE_SEQ_MASK) + CGPU_GATE_SEQ_STEP) | CGPU_GATE_OPEN;
            atomic_store(&t->grants->device[t->slot].probe, others_waiting(g, t) ? opening : 0);
            g->open_word = gate_set(t, CGPU_GATE_OPEN);
            g->idle_since = 0;
            t->idle_out = 0;
            memset(t->idle_probed, 0, sizeof(t->idle_probed));
            memset(t->idle_dead, 0, sizeof(t->idle_dead));
            g->holder = d.key;
            g->charged_to = now;
            g->stats.grants++;
            t->granted++;
        }
        if (tenant_count(g) == 0) {
            g->last_turn = 0;
            pthread_cond_wait(&g->wake, &e->mu);
            continue;
        }
        uint64_t until = now + (d.slice_ns ? d.slice_ns : CGPU_ENGINE_IDLE_POLL_NS);
        if (!d.key && (idle || held) && until > now + CGPU_ENGINE_IDLE_POLL_NS)
            until = now + CGPU_ENGINE_IDLE_POLL_NS;
        struct tenant *h = g->holder ? find(g, g->holder) : NULL;
        if (h && !h->idle_out) {
            if (hold_while_busy(e, g, h, until)) {
                h->idle_out = 1;
                g->stats.idle_handovers++;
                g->busy_from = 0;
                uint64_t at = mono_ns();
                judge_quiet(g, at, 0, 1); /* one judgement at a time */
                g->quiet_key = h->key;
                g->quiet_until = at + CGPU_ENGINE_IDLE_GRACE_NS;
            } else if (h->detach_pending) {
                g->holder = 0; /* detached while the loop slept on its bell (which closed its gate) */
                unmap_tenant(h);
            }
            continue;
        }
        struct timespec ts = abs_timespec(until);
        pthread_cond_timedwait(&g->wake, &e->mu, &ts);
    }
    /* cgpud is going away: nobody may be left waiting for a grant that no
     * one will give. A tenant with a window (`fixed`) keeps to it: its gate
     * closed and cgpud's lock let go, its processes pace themselves as they
     * do when cgpud is killed. The others run unlimited until it is back. */
    for (unsigned i = 0; i < CGPU_SCHED_MAX_TENANTS; i++) {
        struct tenant *t = &g->t[i];
        if (!t->key)
            continue;
        if (t->grants && atomic_load(&t->grants->device[t->slot].alone_period_ns) && !g->ungated) {
            gate_set(t, 0);
            struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET,
                               .l_start = CGPU_GRANTS_LOCK_OFFSET(t->slot), .l_len = 1};
            if (t->locked && fcntl(t->grants_fd, F_OFD_SETLK, &fl) == 0)
                t->locked = 0;
        } else {
            gate_set(t, CGPU_GATE_UNGATED);
            t->overdue = 0;
        }
    }
    g->holder = 0;
    g->running = 0;
    pthread_mutex_unlock(&e->mu);
    return 0;
}

int cgpu_engine_stats_get(struct cgpu_engine *e, unsigned gpu, struct cgpu_engine_stats *out)
{
    struct gpu_loop *g = loop_at(e, gpu);
    if (!g || !out)
        return !e || !out ? CGPU_SCHED_EINVAL : CGPU_SCHED_ENODEV;
    pthread_mutex_lock(&e->mu);
    *out = g->stats;
    out->holder = g->holder;
    out->tenants = tenant_count(g);
    out->paced = g->paced;
    out->pace_refused = g->pace_refused;
    struct cgpu_sched_config c;
    out->policy = cgpu_sched_config_get(e->sched, gpu, &c) == 0 ? c.policy : -1;
    pthread_mutex_unlock(&e->mu);
    return 0;
}

int cgpu_engine_tenant_damaged(struct cgpu_engine *e, unsigned gpu, uint64_t key)
{
    struct tenant *t;
    int rc = lock_tenant(e, gpu, key, NULL, &t);
    if (rc)
        return rc;
    rc = t->usage_guard && cgpu_guard_damaged(t->usage_guard - 1);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int cgpu_engine_tenant_get(struct cgpu_engine *e, unsigned gpu, uint64_t key, struct cgpu_sched_tenant_info *out)
{
    if (!loop_at(e, gpu))
        return e ? CGPU_SCHED_ENODEV : CGPU_SCHED_EINVAL;
    pthread_mutex_lock(&e->mu);
    int rc = cgpu_sched_tenant_get(e->sched, gpu, key, out);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int cgpu_engine_tenant_metrics_get(struct cgpu_engine *e, unsigned gpu, uint64_t key,
                                   struct cgpu_engine_tenant_metrics *out)
{
    if (!out)
        return CGPU_SCHED_EINVAL;
    struct gpu_loop *g;
    struct tenant *t;
    int rc = lock_tenant(e, gpu, key, &g, &t);
    if (rc)
        return rc;
    *out = (struct cgpu_engine_tenant_metrics){.charged_ns = t->charged_ns, .throttled_ns = t->throttled_ns,
                                               .grants = t->granted, .window_ns = g->win_ns,
                                               .window_charged_ns = t->win_charged,
                                               .idle_grace_ns = idle_grace(t)};
    pthread_mutex_unlock(&e->mu);
    return 0;
}
