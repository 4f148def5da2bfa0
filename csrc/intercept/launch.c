/* libcgpu.so: kernel launches, gated by the compute scheduler's grants
 * (protocol in cgpu/region.h).
 *
 * Every launch reads its device's gate word. UNGATED (no compute control):
 * the launch is forwarded at once. OPEN: the launch is counted in flight
 * while the driver takes it. Closed: the thread counts itself waiting and
 * sleeps on the gate (a futex) until cgpud opens it. One fence watcher thread
 * per device and process acknowledges each closing once its work in flight
 * has finished on the device.
 *
 * A process that has nothing in flight and nothing queued while it holds the
 * GPU says so (an idle report in its fence_ack, cgpu/region.h), so that
 * cgpud can pass the GPU on before the slice ends: its watcher does when a
 * grant opens and it has launched nothing since its last fence, and an
 * application thread does when its own synchronisation (cuCtxSynchronize,
 * cuStreamSynchronize, cuEventSynchronize, or a query that finds the work
 * done) returns with nothing launched meanwhile. The next launch withdraws
 * the report. A report is a hint: a stream or event synchronisation says
 * nothing about other streams, and the fence still waits for all of them.
 *
 * No wait is unbounded: a thread at a closed gate looks every
 * GATE_PROBE_NS whether cgpud still holds its lock on the grants file; when
 * nobody does, cgpud is gone and the process launches ungated (fail open,
 * said once on stderr) until the gate word changes, i.e. until a restarted
 * cgpud takes the instance back. And no grant queues without a bound: after
 * `credits` launches since its last fence, a launch first waits for the
 * context's work (a real driver synchronisation), so what a process has
 * queued when its gate closes is at most that many launches. The credits
 * follow how long a drain takes, so that the queue holds a few ms of work:
 * enough that the GPU does not idle while the process refills it, little
 * next to a slice.
 *
 * Ownership: the per-slot state below is process-local; fork resets it.
 * Thread-safety: the launch path takes no lock (the slow path takes
 * gate_lock, never across a driver call and never in a path a launch with
 * an open or absent gate takes). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "libcgpu.h"

#define MAX_CONTEXTS 8
#define INFLIGHT_POLL_NS 20000
/* How long a killed cgpud can hold a launch up beyond its usual wait: a
 * probe is one fcntl, made only by a thread already waiting that long. */
#define GATE_PROBE_NS 50000000
/* A thread with demand is granted within a period (1 s at most) under every
 * policy; a gate that has not moved for this many probes (1.4 s) has lost
 * our demand somehow (e.g. cgpud took a count that a wipe of the usage file
 * left behind for one that killed waiters left) and is asked again. */
#define GATE_STALL_PROBES 28
#define LAUNCH_CREDITS 128       /* to start with */
#define LAUNCH_CREDITS_MIN 2
#define LAUNCH_CREDITS_MAX 8192
#define DRAIN_FAST_NS 2500000    /* a drain quicker than this doubles the credits */
#define DRAIN_SLOW_NS 10000000   /* one slower than this halves them */
#define IDLE_RING_NS 1000000     /* idle reports wake cgpud at most this often per process */
#define PROBE_REST_NS 250000     /* asked to look for idleness: between looks that found work */
/* An open gate this long past its slice's end may be nobody's: the watcher
 * then looks (one fcntl) whether cgpud still holds its lock. */
#define ALONE_AFTER_NS 100000000

struct gate_slot {
    _Atomic uint32_t inflight; /* launches between their gate check and the driver's return */
    /* Launches since the last acknowledgement or drain: the upper half
     * (int32) how many more may go before a drain, the lower half how many
     * went (count_launched). One word, so that a launch counts itself with
     * one instruction (COUNT_STEP) whose sign sends it out of line, and no
     * reader sees half of a restart. Below zero: out of credits (drain
     * first), or IDLE_BIAS lower while this process may have an idle report
     * standing (take it back first); every restart keeps the bias. */
    _Atomic uint64_t count;
    _Atomic uint32_t watched;  /* this process's fence watcher runs */
    _Atomic uint32_t credits;  /* launches allowed between fences before a drain */
    _Atomic uint32_t resets;   /* times `count` restarted: with it, an unchanged (count, resets) means no launch */
    /* The idle report this process has in its fence_ack, 0 for none.
     * The launch hooks do not read it: a report biases `count`. */
    _Atomic uint32_t idle_report;
    _Atomic uint32_t idle_prev;   /* the acknowledgement that report replaced, restored on withdrawal */
    _Atomic uint64_t rung_at;     /* CLOCK_MONOTONIC of this process's last idle wake-up of cgpud */
    _Atomic uint64_t orphaned; /* ORPHANED | the gate word nobody drives, or 0 */
    /* While the instance keeps to its window (pace_alone): launches since
     * the queue was drained, how many may be queued (kept to a few ms of
     * work), the credits an orphaned open gate set aside, the window whose
     * end was drained, how far past that end its queue ran (the next window
     * starts that much later), the device time a launch takes (measured
     * at each drain), when the first launch since the last drain went, and
     * when what is queued should be done. */
    _Atomic uint32_t alone_launched;
    _Atomic uint32_t alone_cap;
    _Atomic uint32_t alone_credits;
    _Atomic uint64_t alone_drained;
    _Atomic uint64_t alone_debt;
    _Atomic uint64_t alone_per;
    _Atomic uint64_t alone_first;
    _Atomic uint64_t alone_busy;
    /* The one stream this process has launched into since its queue was
     * last known empty (a fence or a drain: `launched` counted from 1), or
     * QUEUE_MANY. A stream's synchronisation says the queue is empty only
     * when that stream is the one. */
    _Atomic uintptr_t queue_stream;
    unsigned ncontexts;        /* under gate_lock */
    CUcontext contexts[MAX_CONTEXTS];
} __attribute__((aligned(64)));

#define QUEUE_MANY UINTPTR_MAX     /* queue_stream: launches went to more than one stream */
#define QUEUE_ANY (UINTPTR_MAX - 1) /* a synchronisation whose stream is unknown (an event's) */
#define QUEUE_NONE (UINTPTR_MAX - 2) /* queue_stream: no launch since the queue was last known empty */
/* `count` with `left` launches left before a drain and `launched` made. */
#define COUNT_WORD(left, launched) ((uint64_t)(uint32_t)(int32_t)(left) << 32 | (uint32_t)(launched))
/* Subtracted by each launch: one more launched (the lower half: -(2^32-1)
 * is +1 there with a borrow), so one fewer left (the upper half, through
 * that borrow). The result's sign is the upper half's. */
#define COUNT_STEP 0xffffffffull
/* The bias while an idle report may stand, in `left`. Unbiased, `left` stays
 * within [-2^29, 2^29): at most LAUNCH_CREDITS_MAX, and COUNT_PACED_LEFT
 * less the launches in flight at once; biased, it is below -2^29 and above
 * -2^31. So the bias is read off the word itself, and no restart (a store
 * made from other words) can drop or double it. */
#define IDLE_BIAS (1 << 30)
#define COUNT_BIAS ((uint64_t)IDLE_BIAS << 32)
/* Every launch drains (drain_queue paces it, and stores this again): far
 * from wrapping, and from the bias's range; one launched, so the launches
 * counted are never none. */
#define COUNT_PACED_LEFT (-(1 << 28))
static struct gate_slot slots[CGPU_MAX_DEVICES] = {
    [0 ... CGPU_MAX_DEVICES - 1] = {.count = COUNT_WORD(LAUNCH_CREDITS, 0),
                                    .credits = LAUNCH_CREDITS,
                                    .queue_stream = QUEUE_NONE}};

/* What the launch hooks' inline path reads for each hook: the one-device
 * gate (gate[0]) once a full-path launch has seen init done, one instance
 * device, the fence watcher running (its ledger says `watching`) and the
 * driver's function found; before that (and in a forked child until its own
 * watcher runs) a word that is never open, which sends every launch to the
 * full path. So the inline path needs no test of its own for a watcher, for
 * init or for the driver's pointer. */
static const _Atomic uint32_t never_open = 0;
static const _Atomic uint32_t *_Atomic open_gate[HOOK_COUNT] = {[0 ... HOOK_COUNT - 1] = &never_open};

static inline uint32_t count_launched(uint64_t count)
{
    return (uint32_t)count;
}

static inline bool count_biased(uint64_t count)
{
    return (int32_t)(count >> 32) < -(IDLE_BIAS / 2);
}

/* Launches left before a drain, without the bias. */
static inline int32_t count_left(uint64_t count)
{
    int32_t left = (int32_t)(count >> 32);
    return count_biased(count) ? left + IDLE_BIAS : left;
}

/* Sets (or clears) the bias unless it is so already. Whoever reads the
 * count after this sees it: a launch that counts itself there goes out of
 * line and looks for a report to take back. */
static void count_set_bias(_Atomic uint64_t *count, bool on)
{
    uint64_t c = atomic_load(count);
    while (count_biased(c) != on && !atomic_compare_exchange_weak(count, &c, on ? c - COUNT_BIAS : c + COUNT_BIAS))
        ;
}

/* Restarts the count with `left` launches left and `launched` made,
 * keeping the bias (a report may stand); returns the word it replaced. */
static uint64_t count_restart(_Atomic uint64_t *count, int32_t left, uint32_t launched)
{
    uint64_t c = atomic_load(count);
    while (!atomic_compare_exchange_weak(count, &c,
                                         COUNT_WORD(left, launched) - (count_biased(c) ? COUNT_BIAS : 0)))
        ;
    return c;
}

static uint32_t launched_since(struct gate_slot *s)
{
    return count_launched(atomic_load(&s->count));
}
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool refusal_logged;
static atomic_bool contexts_full_logged;
static atomic_bool watcher_failure_logged;
static atomic_bool orphan_logged;

#define ORPHANED (1ull << 32)

void cgpu_gate_after_fork(void)
{
    pthread_mutex_init(&gate_lock, NULL);
    for (unsigned i = 0; i < CGPU_MAX_DEVICES; i++) {
        atomic_store(&slots[i].inflight, 0);
        atomic_store(&slots[i].count, COUNT_WORD(LAUNCH_CREDITS, 0));
        atomic_store(&slots[i].queue_stream, QUEUE_NONE);
        atomic_store(&slots[i].watched, 0);
        atomic_store(&slots[i].orphaned, 0);
        atomic_store(&slots[i].credits, LAUNCH_CREDITS);
        atomic_store(&slots[i].resets, 0);
        atomic_store(&slots[i].idle_report, 0);
        atomic_store(&slots[i].alone_launched, 0);
        atomic_store(&slots[i].alone_credits, 0);
        atomic_store(&slots[i].alone_drained, 0);
        atomic_store(&slots[i].alone_debt, 0);
        atomic_store(&slots[i].alone_per, 0);
        atomic_store(&slots[i].alone_first, 0);
        atomic_store(&slots[i].alone_busy, 0);
        atomic_store(&slots[i].alone_cap, 0);
        slots[i].ncontexts = 0;
    }
    /* No watcher in the child: its launches take the full path until one runs. */
    for (unsigned i = 0; i < HOOK_COUNT; i++)
        atomic_store(&open_gate[i], &never_open);
}

/* Shared futexes: the words live in MAP_SHARED file mappings. */
static void futex_wait(const _Atomic uint32_t *word, uint32_t expected)
{
    syscall(SYS_futex, (uintptr_t)word, FUTEX_WAIT, expected, NULL, NULL, 0);
}

/* True when the wait ran out rather than being woken or the word moving. */
static bool futex_wait_timed(const _Atomic uint32_t *word, uint32_t expected, long ns)
{
    struct timespec rel = {ns / 1000000000L, ns % 1000000000L};
    return syscall(SYS_futex, (uintptr_t)word, FUTEX_WAIT, expected, &rel, NULL, 0) != 0 && errno == ETIMEDOUT;
}

static void futex_wake_all(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uintptr_t)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* ---- contexts to synchronise at a fence ------------------------------------ */

static void remember_context(struct gate_slot *s, CUcontext ctx)
{
    if (!ctx)
        return;
    bool full = false;
    pthread_mutex_lock(&gate_lock);
    unsigned i = 0;
    while (i < s->ncontexts && s->contexts[i] != ctx)
        i++;
    if (i == s->ncontexts) {
        if (i < MAX_CONTEXTS)
            s->contexts[s->ncontexts++] = ctx;
        else
            full = true;
    }
    pthread_mutex_unlock(&gate_lock);
    if (full && !atomic_exchange(&contexts_full_logged, true))
        cgpu_log(CGPU_LOG_ERROR, "more than %d contexts on one GPU: the work of the others is not fenced",
                 MAX_CONTEXTS);
}

static void remember_current_context(struct gate_slot *s)
{
    CUcontext ctx = NULL;
    __typeof__(&cuCtxGetCurrent) get = REAL(cuCtxGetCurrent);
    if (get && get(&ctx) == CUDA_SUCCESS)
        remember_context(s, ctx);
}

static void forget_context(struct gate_slot *s, CUcontext ctx)
{
    pthread_mutex_lock(&gate_lock);
    for (unsigned i = 0; i < s->ncontexts; i++) {
        if (s->contexts[i] == ctx) {
            s->contexts[i] = s->contexts[--s->ncontexts];
            break;
        }
    }
    pthread_mutex_unlock(&gate_lock);
}

/* Waits for the work the process queued in every recorded context. */
static void synchronize_contexts(struct gate_slot *s)
{
    CUcontext ctx[MAX_CONTEXTS];
    pthread_mutex_lock(&gate_lock);
    unsigned n = s->ncontexts;
    for (unsigned i = 0; i < n; i++)
        ctx[i] = s->contexts[i];
    pthread_mutex_unlock(&gate_lock);
    __typeof__(&cuCtxPushCurrent_v2) push = REAL(cuCtxPushCurrent_v2);
    __typeof__(&cuCtxPopCurrent_v2) pop = REAL(cuCtxPopCurrent_v2);
    __typeof__(&cuCtxSynchronize) sync = REAL(cuCtxSynchronize);
    if (!push || !pop || !sync)
        return;
    for (unsigned i = 0; i < n; i++) {
        if (push(ctx[i]) != CUDA_SUCCESS) {
            forget_context(s, ctx[i]); /* destroyed: nothing left to wait for */
            continue;
        }
        sync(); /* an error here means the context's work is over too */
        CUcontext popped;
        pop(&popped);
    }
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- idle reports ------------------------------------------------------------------ */

/* (launched, resets) in one word: equal marks mean no launch in between. */
static uint64_t launch_mark(struct gate_slot *s)
{
    return (uint64_t)atomic_load(&s->resets) << 32 | count_launched(atomic_load(&s->count));
}

static struct cgpu_proc_ledger *own_ledger(void)
{
    return g_cgpu.ledger >= 0 ? &g_cgpu.usage->proc[g_cgpu.ledger] : NULL;
}

/* Takes this process's idle report out of its fence_ack, unless an
 * acknowledgement has replaced it already. Lock-free: launches call it. */
static __attribute__((noinline, cold)) void withdraw_idle(struct gate_slot *s, unsigned slot)
{
    uint32_t report = atomic_exchange(&s->idle_report, 0);
    struct cgpu_proc_ledger *ledger = own_ledger();
    if (report && ledger)
        atomic_compare_exchange_strong(&ledger->fence_ack[slot], &report, atomic_load(&s->idle_prev));
}

/* Says in the ledger that this process holds the open grant with nothing in
 * flight and nothing launched since `mark` was taken (after a drain: a fence
 * or the application's own synchronisation), and rings the bell so cgpud
 * looks. `drained`: the whole queue is known empty (a fence, or a context
 * synchronisation in the one context it launches in), so cgpud need not
 * wait for a fence when it passes the GPU on. A report never replaces the
 * acknowledgement of a later closing. */
static void cgpu_report_idle(unsigned slot, uint64_t mark, bool drained, bool ring)
{
    struct gate_slot *s = &slots[slot];
    if (!atomic_load_explicit(&s->watched, memory_order_acquire))
        return;
    struct cgpu_proc_ledger *ledger = own_ledger();
    uint32_t g = atomic_load(g_cgpu.gate[slot]);
    if (!ledger || (g & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED)) != CGPU_GATE_OPEN)
        return;
    if (drained) {
        pthread_mutex_lock(&gate_lock);
        drained = s->ncontexts <= 1;
        pthread_mutex_unlock(&gate_lock);
    }
    uint32_t report = (g & CGPU_GATE_SEQ_MASK) | CGPU_ACK_IDLE | (drained ? CGPU_ACK_DRAINED : 0);
    if (atomic_load(&s->idle_report) == report)
        return;
    pthread_mutex_lock(&gate_lock);
    uint32_t ack = atomic_load(&ledger->fence_ack[slot]);
    bool posted = false;
    if ((int32_t)((ack & CGPU_GATE_SEQ_MASK) - (report & CGPU_GATE_SEQ_MASK)) < 0) {
        atomic_store(&s->idle_prev, ack);
        posted = atomic_compare_exchange_strong(&ledger->fence_ack[slot], &ack, report);
        if (posted) {
            /* Once posted: a launch that takes idle_report back then finds
             * it in fence_ack. Then the bias: a launch that counts itself
             * after it goes out of line, and finds idle_report. */
            atomic_store(&s->idle_report, report);
            count_set_bias(&s->count, true);
            /* A launch counts itself in flight, then in `count`: either it
             * sees the bias and withdraws the report, or this sees it here. */
            if (atomic_load(&s->inflight) != 0 || launch_mark(s) != mark) {
                withdraw_idle(s, slot);
                /* No other report stands (they are made under gate_lock). */
                count_set_bias(&s->count, false);
                posted = false;
            }
        }
    }
    pthread_mutex_unlock(&gate_lock);
    if (!posted)
        return;
    /* Every report moves the bell, so cgpud can tell a report that stood
     * from one withdrawn and made again; the wake-up (a syscall, and a
     * wake-up in cgpud) at most once per IDLE_RING_NS: cgpud looks again
     * on its own after a ring that found this process busy. */
    struct cgpu_device_usage *dev = &g_cgpu.usage->device[slot];
    atomic_fetch_add(&dev->bell, 1);
    uint64_t now = mono_ns(), last = atomic_load_explicit(&s->rung_at, memory_order_relaxed);
    if (ring && now - last >= IDLE_RING_NS && atomic_compare_exchange_strong(&s->rung_at, &last, now))
        futex_wake_all(&dev->bell);
}

/* ---- while cgpud is away ------------------------------------------------------ */

static bool gate_orphaned(int slot);
static void note_orphaned(int slot, uint32_t g);

/* The slot's grant: the gate word is its first member. NULL without a
 * mapped grants file. */
static const struct cgpu_device_grant *grant_at(unsigned slot)
{
    return g_cgpu.grants_fd >= 0 && !g_cgpu.launches_refused
               ? (const struct cgpu_device_grant *)(const void *)g_cgpu.gate[slot]
               : NULL;
}


/* Whether cgpud, while it runs, leaves the instance to keep to its window
 * under the closed gate word `g` (the grant's `paced`): paced as when it is
 * away, and nothing to say about it. */
static bool paced_on(unsigned slot, uint32_t g)
{
    const struct cgpu_device_grant *d = grant_at(slot);
    return d && g && atomic_load_explicit(&d->paced, memory_order_acquire) == g;
}

/* Whether a launch at gate word `g` keeps to the instance's window by
 * itself: cgpud is gone (orphaned) or leaves it to the instance (paced_on). */
static bool keeps_to_window(unsigned slot, uint32_t g)
{
    return atomic_load(&slots[slot].orphaned) == (ORPHANED | g) || paced_on(slot, g);
}

/* Waits for the calling thread's context; returns when it had drained. */
static uint64_t drain_current(void)
{
    __typeof__(&cuCtxSynchronize) sync = REAL(cuCtxSynchronize);
    if (sync)
        sync();
    return mono_ns();
}

/* The queue drained at `done` after `launched` launches since the last
 * drain, the first of them at alone_first: each took at most (done -
 * first) / launched of device time (less if the process paused between
 * launches, or a neighbour's overrun ran first). A bound: the estimate
 * drops to a lower one at once and rises a quarter of the way to a higher
 * one, so that pauses barely lift it while kernels that grew still do. */
static void drained(struct gate_slot *s, uint32_t launched, uint64_t done)
{
    uint64_t first = atomic_load(&s->alone_first);
    if (launched && first && done > first) {
        uint64_t per = (done - first) / launched, old = atomic_load(&s->alone_per);
        atomic_store(&s->alone_per, !old || per < old ? per : old + (per - old) / 4);
        if (g_cgpu.usage) /* for metrics: what the window was used for */
            atomic_fetch_add_explicit(&g_cgpu.usage->device[s - slots].paced_ns, done - first,
                                      memory_order_relaxed);
    }
    atomic_store(&s->alone_busy, done);
    atomic_store(&s->alone_launched, 0);
}

/* cgpud is away and nobody drives the gate word `g`, or cgpud leaves the
 * instance to itself under it (paced_on): this launch keeps to the
 * instance's window (the grant's alone_*, which cgpud tiled with its
 * neighbours'). Inside the window it goes at once if what is queued, and
 * at least half of this launch, should be done by the window's end (the
 * device time a launch takes is measured between drains; half, so that
 * kernels that do not divide the window lose no share on average); when it
 * would not, the queue is drained first and the launch looks again, so the
 * queue runs out at about the end and not far into the next instance's
 * window (a launch longer than half the window goes whenever nothing is
 * queued). The queue is also kept to a few ms of work, and at most a
 * quarter of a short window. Past
 * the window, the process waits for what it queued (once per window, by
 * one thread), starts its next window as much later as that ran past the
 * end (so each instance gets the length of its window), and sleeps until
 * then. Returns at once without a window (fail open), and as soon as the
 * gate word moves. Each sleep is shorter than a period. */
static void pace_alone(unsigned slot, uint32_t g)
{
    const struct cgpu_device_grant *d = grant_at(slot);
    if (!d)
        return;
    uint64_t p = atomic_load_explicit(&d->alone_period_ns, memory_order_relaxed);
    uint64_t start = atomic_load_explicit(&d->alone_start_ns, memory_order_relaxed);
    uint64_t len = atomic_load_explicit(&d->alone_len_ns, memory_order_relaxed);
    if (!p || !len || len >= p || start >= p)
        return;
    struct gate_slot *s = &slots[slot];
    const _Atomic uint32_t *gate = g_cgpu.gate[slot];
    for (;;) {
        uint64_t now = mono_ns();
        uint64_t pos = (now % p + p - start) % p; /* since this instance's window last opened */
        uint64_t opened = now - pos, end = opened + len;
        uint64_t debt = atomic_load(&s->alone_debt);
        if (pos >= debt && pos < len) {
            uint64_t per = atomic_load(&s->alone_per), busy = atomic_load(&s->alone_busy);
            uint64_t from = busy > now ? busy : now;
            /* A few ms queued at most, and at most a quarter of a short window.
             * Launches too long to pack into the window go one at a time
             * (what runs past the end is paid back): never none. */
            uint64_t slow = len / 4 < DRAIN_SLOW_NS ? len / 4 : DRAIN_SLOW_NS;
            uint64_t fast = len / 16 < DRAIN_FAST_NS ? len / 16 : DRAIN_FAST_NS;
            if (!per || (from + per / 2 <= end && from - now <= slow) || (per > len / 2 && busy <= now)) {
                uint32_t cap = atomic_load(&s->alone_cap);
                if (!cap)
                    cap = LAUNCH_CREDITS;
                uint32_t launched = atomic_fetch_add(&s->alone_launched, 1);
                if (!launched)
                    atomic_store(&s->alone_first, now);
                if (launched >= cap) {
                    uint64_t done = drain_current(), took = done - now;
                    if (took < fast && cap < LAUNCH_CREDITS_MAX)
                        cap *= 2;
                    else if (took > slow && cap > LAUNCH_CREDITS_MIN)
                        cap /= 2;
                    atomic_store(&s->alone_cap, cap);
                    drained(s, launched, done);
                    continue; /* the drain took time: the window may be over by now */
                }
                if (per)
                    atomic_store(&s->alone_busy, from + per);
                return;
            }
            if (busy > now) { /* the queue is full, or runs to about the end: wait for it, then look again */
                drained(s, atomic_load(&s->alone_launched), drain_current());
                continue;
            }
            /* Nothing queued, and no room for a launch before the end. */
        }
        uint64_t seen = atomic_load(&s->alone_drained);
        if (pos >= len && seen != opened && atomic_compare_exchange_strong(&s->alone_drained, &seen, opened)) {
            /* What ran past the end is paid for at the start of the next. */
            uint64_t done = drain_current();
            atomic_store(&s->alone_debt, done > end ? (done - end < len ? done - end : len) : 0);
            drained(s, atomic_load(&s->alone_launched), done);
            continue;
        }
        if (pos < debt) { /* paying: wait until the debt is paid */
            futex_wait_timed(gate, g, (long)(debt - pos));
            if (atomic_load(gate) != g)
                return;
            continue;
        }
        uint64_t wait = pos < len ? len - pos : p - pos; /* no room before the end: sleep past it */
        futex_wait_timed(gate, g, (long)wait);
        if (atomic_load(gate) != g)
            return;
    }
}

/* The watcher of an open gate past its slice's end: if nobody drives it
 * and the instance has a window, every launch of this process from now on
 * takes the slow path (no credits), which paces it (drain_queue). Without
 * a window the open gate already lets launches through: nothing to do. */
static void orphan_open_gate(unsigned slot, uint32_t g)
{
    struct gate_slot *s = &slots[slot];
    const struct cgpu_device_grant *d = grant_at(slot);
    if (!d || !atomic_load(&d->alone_period_ns) || atomic_load(&s->orphaned) == (ORPHANED | g) ||
        !gate_orphaned((int)slot) || atomic_load(g_cgpu.gate[slot]) != g)
        return;
    note_orphaned((int)slot, g);
    uint32_t c = atomic_exchange(&s->credits, 0);
    if (c)
        atomic_store(&s->alone_credits, c);
    count_restart(&s->count, COUNT_PACED_LEFT, 1);
}

/* ---- the fence watcher ------------------------------------------------------- */

static void acknowledge(unsigned slot, uint32_t seq, struct cgpu_proc_ledger *ledger)
{
    struct gate_slot *s = &slots[slot];
    /* A launch that saw the gate open is counted before it looks again, so
     * once this reads zero every launch of the closed grant is in the driver. */
    while (atomic_load(&s->inflight) != 0) {
        struct timespec ts = {0, INFLIGHT_POLL_NS};
        nanosleep(&ts, NULL);
    }
    uint32_t allowed = atomic_load_explicit(&s->credits, memory_order_relaxed);
    atomic_store_explicit(&s->queue_stream, QUEUE_NONE, memory_order_relaxed); /* emptied by the fence below */
    bool launched = count_launched(count_restart(&s->count, (int32_t)allowed, 0)) != 0;
    atomic_fetch_add(&s->resets, 1);
    /* The acknowledgement below replaces the report (the bias stays: the
     * next launch goes out of line once and finds none). */
    atomic_store(&s->idle_report, 0);
    if (launched)
        synchronize_contexts(s);
    atomic_store_explicit(&ledger->fence_ack[slot], seq | (launched ? CGPU_ACK_LAUNCHED : 0), memory_order_release);
    struct cgpu_device_usage *dev = &g_cgpu.usage->device[slot];
    atomic_fetch_add(&dev->bell, 1);
    futex_wake_all(&dev->bell);
}

/* Asked by cgpud (the grant's `probe`, cgpu/region.h): whether this
 * process's queue is empty, learned however the application waits for its
 * work, or if it never does. The watcher synchronises every context the
 * process launched in (a real driver call, off the launch path); if nothing
 * was in flight before and nothing launched since, the queue is empty and
 * the grant idle. Returns when a report stands or the gate has moved; the
 * caller looks again PROBE_REST_NS later, so a report a launch withdrew is
 * made again once that work is done. */
static void look_for_idle(unsigned slot, uint32_t g)
{
    struct gate_slot *s = &slots[slot];
    const _Atomic uint32_t *gate = g_cgpu.gate[slot];
    /* Nothing launched since the fence: the watcher's report at the grant
     * (which wakes nobody, as the threads let through launch at once) says
     * it; one that rang here would race them. */
    while (atomic_load(gate) == g && atomic_load(&s->idle_report) == 0 && launched_since(s) != 0) {
        /* The mark before the in-flight count: a launch counted in flight
         * after this look moves the mark before it reaches the driver. */
        uint64_t mark = launch_mark(s);
        /* Threads still counted at the gate have just been let through it
         * (the look that follows a grant races them): not idle. */
        const _Atomic uint32_t *waiting = &g_cgpu.usage->device[slot].waiting;
        if (atomic_load(&s->inflight) == 0 && atomic_load(waiting) == 0) {
            synchronize_contexts(s);
            if (atomic_load(&s->inflight) == 0 && atomic_load(waiting) == 0 && launch_mark(s) == mark) {
                cgpu_report_idle(slot, mark, true, true);
                return;
            }
        }
        futex_wait_timed(gate, g, PROBE_REST_NS);
    }
}

/* The watcher's argument: its slot and its ledger, in one pointer-sized value. */
static void *watch(void *arg)
{
    uintptr_t v = (uintptr_t)arg;
    unsigned slot = (unsigned)(v % CGPU_MAX_DEVICES);
    struct cgpu_proc_ledger *ledger = &g_cgpu.usage->proc[v / CGPU_MAX_DEVICES];
    const _Atomic uint32_t *gate = g_cgpu.gate[slot];
    /* The gate word is the first of its grant (the watcher only runs on a
     * mapped grants file). */
    const _Atomic uint32_t *probe = &((const struct cgpu_device_grant *)(const void *)gate)->probe;
    const _Atomic uint64_t *slice_end = &((const struct cgpu_device_grant *)(const void *)gate)->slice_end_ns;
    struct gate_slot *s = &slots[slot];
    bool acked = false;
    uint32_t acked_seq = 0;
    for (;;) {
        uint32_t g = atomic_load(gate);
        uint32_t seq = g & CGPU_GATE_SEQ_MASK;
        /* cgpud is back (the word moved): launches take credits again. */
        if (!atomic_load(&s->credits) && atomic_load(&s->orphaned) != (ORPHANED | g)) {
            uint32_t c = atomic_exchange(&s->alone_credits, 0);
            atomic_store(&s->credits, c ? c : LAUNCH_CREDITS);
        }
        if (!(g & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED)) && (!acked || seq != acked_seq)) {
            acknowledge(slot, seq, ledger);
            acked = true;
            acked_seq = seq;
            continue;
        }
        /* A grant to a process that has launched nothing since its last
         * fence (which drained its queue): idle from the start. No wake-up:
         * its threads waiting at the gate launch at once, and cgpud looks
         * when another process's report rings. */
        bool open = (g & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED)) == CGPU_GATE_OPEN;
        if (!open) {
            futex_wait(gate, g);
            continue;
        }
        if (atomic_load(&s->orphaned) == (ORPHANED | g)) {
            futex_wait(gate, g); /* paced by the launches themselves until the word moves */
            continue;
        }
        uint64_t now = mono_ns(), lost = atomic_load(slice_end) + ALONE_AFTER_NS;
        if (now >= lost) {
            orphan_open_gate(slot, g);
            lost = now + ALONE_AFTER_NS; /* a lone holder keeps its word past the slice: look again later */
        }
        if (launched_since(s) == 0)
            cgpu_report_idle(slot, launch_mark(s), true, false);
        if (atomic_load(probe) == g) {
            look_for_idle(slot, g);
            futex_wait_timed(gate, g, PROBE_REST_NS);
            continue;
        }
        futex_wait_timed(gate, g, (long)(lost - now));
    }
    return NULL;
}

/* Starts this process's watcher for the slot once; false if it cannot run.
 * The ledger says `watching` before any launch this process makes in the
 * grant, so cgpud never closes a gate without waiting for this fence. */
static bool ensure_watcher(unsigned slot)
{
    struct gate_slot *s = &slots[slot];
    if (atomic_load_explicit(&s->watched, memory_order_acquire))
        return true;
    pthread_mutex_lock(&g_cgpu.ledger_lock);
    bool ok = atomic_load(&s->watched) || cgpu_claim_ledger_locked() == 0;
    if (ok && !atomic_load(&s->watched)) {
        _Atomic uint32_t *watching = &g_cgpu.usage->proc[g_cgpu.ledger].watching;
        uint32_t bit = 1u << slot;
        bool was = atomic_fetch_or(watching, bit) & bit;
        void *arg = (void *)((uintptr_t)g_cgpu.ledger * CGPU_MAX_DEVICES + slot);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old); /* the application's signals are not ours */
        pthread_t tid;
        ok = pthread_create(&tid, &attr, watch, arg) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (ok) {
            pthread_setname_np(tid, "cgpu-fence");
            /* Launch hooks take the inline path (open_gate) only once a
             * full-path launch has seen this. */
            atomic_store_explicit(&s->watched, 1, memory_order_release);
        } else if (!was) {
            atomic_fetch_and(watching, ~bit); /* nobody would acknowledge */
        }
    }
    pthread_mutex_unlock(&g_cgpu.ledger_lock);
    if (ok)
        remember_current_context(s);
    else if (!atomic_exchange(&watcher_failure_logged, true))
        cgpu_log(CGPU_LOG_ERROR, "cannot start the fence watcher for %s: launches there fail",
                 g_cgpu.device[slot].uuid);
    return ok;
}

/* ---- the gate -------------------------------------------------------------------- */

#define GATE_FREE (-1)  /* launch; nothing to do after */
#define GATE_ERROR (-2) /* do not launch */

static int slot_of_current_context(void)
{
    CUdevice dev;
    __typeof__(&cuCtxGetDevice) get_dev = REAL(cuCtxGetDevice);
    if (!get_dev || get_dev(&dev) != CUDA_SUCCESS)
        return GATE_FREE; /* no context: the driver's error to give */
    int slot = cgpu_slot_of_cuda_device(dev);
    return slot >= 0 ? slot : GATE_FREE; /* a GPU outside the instance is not scheduled here */
}

/* Takes back this process's idle report, if one may stand, for a launch
 * counted in flight: the bias first (a report posted after this biases the
 * count again), then the report. */
static inline void take_back_idle(struct gate_slot *s)
{
    if (CGPU_UNLIKELY(count_biased(atomic_load(&s->count))))
        count_set_bias(&s->count, false);
    if (CGPU_UNLIKELY(atomic_load(&s->idle_report) != 0))
        withdraw_idle(s, (unsigned)(s - slots));
}

/* Counts the launch in flight if the gate is still open once it is counted:
 * either the watcher then sees the count, or this sees the gate closed.
 * False if closed; else *count is `count` with this launch in it. */
static inline bool hold_open_gate(const _Atomic uint32_t *gate, struct gate_slot *s, uint64_t *count)
{
    atomic_fetch_add(&s->inflight, 1);
    /* Withdrawn before the gate is read, as cgpud closes the gate before it
     * reads the reports: either this sees the gate closed, or cgpud sees
     * the report gone and waits for the fence. */
    take_back_idle(s);
    if (CGPU_LIKELY(atomic_load(gate) & CGPU_GATE_OPEN)) {
        *count = atomic_fetch_sub(&s->count, COUNT_STEP) - COUNT_STEP;
        return true;
    }
    atomic_fetch_sub_explicit(&s->inflight, 1, memory_order_release);
    return false;
}

/* Out of credits: the process's queue on this GPU drains before it grows.
 * Counted in flight meanwhile, so a closing fence waits for this too. A
 * launch into a stream being captured queues nothing (it records a graph
 * node), and synchronising would end the capture: no drain then, nor when
 * the driver cannot say (a query refused during another thread's capture). */
static __attribute__((noinline, cold)) void drain_queue(struct gate_slot *s, CUstream stream)
{
    /* An open gate nobody drives (its credits taken: orphan_open_gate). */
    unsigned slot = (unsigned)(s - slots);
    uint32_t g = atomic_load(g_cgpu.gate[slot]);
    if (atomic_load(&s->orphaned) == (ORPHANED | g)) {
        /* Paced here until the word moves. */
        count_restart(&s->count, COUNT_PACED_LEFT, 1);
        pace_alone(slot, g);
        return;
    }
    __typeof__(&cuStreamIsCapturing) capturing = REAL(cuStreamIsCapturing);
    __typeof__(&cuCtxSynchronize) sync = REAL(cuCtxSynchronize);
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    if (capturing && sync && capturing(stream, &status) == CUDA_SUCCESS && status == CU_STREAM_CAPTURE_STATUS_NONE) {
        uint64_t t0 = mono_ns();
        sync();
        uint64_t took = mono_ns() - t0;
        /* The drain took as long as the queue's work: keep that a few ms. */
        uint32_t c = atomic_load_explicit(&s->credits, memory_order_relaxed);
        if (took < DRAIN_FAST_NS && c < LAUNCH_CREDITS_MAX)
            atomic_store_explicit(&s->credits, c * 2, memory_order_relaxed);
        else if (took > DRAIN_SLOW_NS && c > LAUNCH_CREDITS_MIN)
            atomic_store_explicit(&s->credits, c / 2, memory_order_relaxed);
    }
    /* This launch is the first of the new count. */
    count_restart(&s->count, (int32_t)atomic_load_explicit(&s->credits, memory_order_relaxed) - 1, 1);
    atomic_store_explicit(&s->queue_stream, (uintptr_t)stream, memory_order_relaxed);
    atomic_fetch_add(&s->resets, 1);
}

/* Records where a launch since the queue was last empty goes: the first
 * (QUEUE_NONE before it) names its stream, by a compare-and-swap so that
 * of two racing first launches into two streams the second sees the
 * first's; one into another stream makes it QUEUE_MANY, a plain store:
 * QUEUE_MANY is always true of a queue that is not empty, and no fence
 * (which sets QUEUE_NONE) runs while this launch is in flight. Into the
 * stream already recorded nothing changes, so the common case is one
 * compare and needs no count of launches; no call and no register beyond
 * the stream's, so the launch hooks keep their arguments in place. */
static inline void track_stream(struct gate_slot *s, CUstream stream)
{
    uintptr_t q = atomic_load_explicit(&s->queue_stream, memory_order_relaxed);
    if (CGPU_LIKELY(q == (uintptr_t)stream))
        return;
    /* Whether it worked is in q: still QUEUE_NONE, or what another put there. */
    if (q == QUEUE_NONE)
        (void)atomic_compare_exchange_strong_explicit(&s->queue_stream, &q, (uintptr_t)stream, memory_order_relaxed,
                                                      memory_order_relaxed);
    if (q != QUEUE_NONE && q != (uintptr_t)stream && q != QUEUE_MANY)
        atomic_store_explicit(&s->queue_stream, QUEUE_MANY, memory_order_relaxed);
}

/* True when no cgpud holds the lock on the slot's gate: nobody will open it.
 * A probe that fails says so too, so that a wait never outlives it. */
static bool gate_orphaned(int slot)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = CGPU_GRANTS_LOCK_OFFSET(slot), .l_len = 1};
    return g_cgpu.grants_fd < 0 || fcntl(g_cgpu.grants_fd, F_OFD_GETLK, &fl) != 0 || fl.l_type == F_UNLCK;
}

static void note_orphaned(int slot, uint32_t g)
{
    atomic_store(&slots[slot].orphaned, ORPHANED | g);
    const struct cgpu_device_grant *d = grant_at((unsigned)slot);
    bool window = d && atomic_load(&d->alone_period_ns) != 0;
    if (!atomic_exchange(&orphan_logged, true))
        fprintf(stderr, "cgpu[%d]: the compute scheduler (cgpud) is gone; kernel launches %s until it is back\n",
                (int)getpid(), window ? "keep to the instance's share" : "run ungated");
}

/* Takes back what this thread added to `waiting`, never below zero: the
 * word lives in the tenant-writable usage file and may have been reset. */
static void uncount_waiting(_Atomic uint32_t *waiting, uint32_t counted)
{
    uint32_t w = atomic_load(waiting);
    while (!atomic_compare_exchange_weak(waiting, &w, w > counted ? w - counted : 0))
        ;
}

/* Everything but an open gate with its watcher running and an absent one. */
static __attribute__((noinline, cold)) int gate_slow(int slot, CUresult *err, CUstream stream)
{
    if (g_cgpu.launches_refused) {
        if (g_cgpu.refused_why[0] && !atomic_exchange(&refusal_logged, true))
            fprintf(stderr, "cgpu[%d]: compute grants unavailable (%s); kernel launches will fail\n",
                    (int)getpid(), g_cgpu.refused_why);
        *err = CUDA_ERROR_NOT_PERMITTED;
        return GATE_ERROR;
    }
    const _Atomic uint32_t *gate = g_cgpu.gate[slot];
    struct gate_slot *s = &slots[slot];
    for (;;) {
        uint32_t g = atomic_load_explicit(gate, memory_order_acquire);
        if (g & CGPU_GATE_UNGATED)
            return GATE_FREE;
        if (keeps_to_window((unsigned)slot, g)) {
            pace_alone((unsigned)slot, g);
            return GATE_FREE;
        }
        if (!ensure_watcher((unsigned)slot)) {
            *err = CUDA_ERROR_OUT_OF_MEMORY;
            return GATE_ERROR;
        }
        uint64_t count;
        if ((g & CGPU_GATE_OPEN) && hold_open_gate(gate, s, &count)) {
            if (count_left(count) < 0)
                drain_queue(s, stream);
            track_stream(s, stream);
            return slot;
        }
        if (g & CGPU_GATE_OPEN)
            continue; /* closed between the two looks */
        remember_current_context(s);
        _Atomic uint32_t *waiting = &g_cgpu.usage->device[slot].waiting;
        uint32_t counted = 1, stalled = 0;
        atomic_fetch_add(waiting, 1);
        atomic_fetch_add_explicit(&g_cgpu.usage->device[slot].gated, 1, memory_order_relaxed);
        while (!((g = atomic_load_explicit(gate, memory_order_acquire)) & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED))) {
            if (keeps_to_window((unsigned)slot, g))
                break;
            /* EINTR, EAGAIN: look again. Only a wait that ran out with the
             * word unchanged costs a probe. */
            if (!futex_wait_timed(gate, g, GATE_PROBE_NS) || atomic_load(gate) != g)
                continue;
            if (gate_orphaned(slot)) {
                note_orphaned(slot, g);
            } else if ((atomic_load(waiting) == 0 || ++stalled >= GATE_STALL_PROBES) && counted < UINT32_MAX) {
                /* Our demand was wiped with the usage file (a process of
                 * this instance cut or scribbled it), or cgpud no longer
                 * counts it: it would never grant. Ask again. */
                atomic_fetch_add(waiting, 1);
                counted++;
                stalled = 0;
            }
        }
        uncount_waiting(waiting, counted);
    }
}

/* The slot whose grant the caller holds (call gate_leave after the
 * driver), GATE_FREE, or GATE_ERROR with *err set. */
/* Inlined into every hook: a call here would spill the hook's eleven
 * arguments around it on the hot path. */
static inline __attribute__((always_inline)) int gate_enter(CUresult *err, CUstream stream)
{
    (void)cgpu_state();
    int slot = CGPU_LIKELY(g_cgpu.device_count <= 1) ? 0 : slot_of_current_context();
    if (slot < 0)
        return slot;
    const _Atomic uint32_t *gate = g_cgpu.gate[slot];
    uint32_t g = atomic_load_explicit(gate, memory_order_acquire);
    if (CGPU_LIKELY(g & CGPU_GATE_UNGATED))
        return GATE_FREE;
    struct gate_slot *s = &slots[slot];
    if (CGPU_LIKELY((g & CGPU_GATE_OPEN) && atomic_load_explicit(&s->watched, memory_order_acquire))) {
        uint64_t count;
        if (CGPU_LIKELY(hold_open_gate(gate, s, &count))) {
            if (CGPU_UNLIKELY(count_left(count) < 0))
                drain_queue(s, stream);
            track_stream(s, stream);
            return slot;
        }
    }
    return gate_slow(slot, err, stream);
}

static inline void gate_leave(int slot)
{
    if (slot >= 0)
        atomic_fetch_sub_explicit(&slots[slot].inflight, 1, memory_order_release);
}

/* ---- the launch hooks' hot path ----------------------------------------------------- */

enum { HOLD_NO, HOLD_YES, HOLD_COLD };

static void publish_open_gate(enum cgpu_hook_id id)
{
    const _Atomic uint32_t *gate = atomic_load_explicit(&g_cgpu.launch_gate, memory_order_acquire);
    if (g_cgpu.device_count <= 1 && gate == g_cgpu.gate[0] &&
        atomic_load_explicit(&slots[0].watched, memory_order_acquire) &&
        atomic_load_explicit(&g_real[id], memory_order_acquire) &&
        atomic_load_explicit(&open_gate[id], memory_order_relaxed) != gate)
        atomic_store_explicit(&open_gate[id], gate, memory_order_release);
}

/* gate_enter's open-gate case on the one-device gate (open_gate), without a
 * call: HOLD_YES, the grant is held (gate_leave(0) after the driver);
 * HOLD_COLD, held but `count` went below zero (hold_cold decides); HOLD_NO,
 * nothing is left counted and the full path decides. The steps and their
 * order are hold_open_gate's, with no first look at the gate: the count in
 * flight first (undone if the gate turns out closed, as hold_open_gate does
 * when it closed between two looks), then the gate, then one step of
 * `count`, whose sign says "drain" or "an idle report may stand" (the
 * bias): it is seq_cst, as the report's poster biases the count and then
 * reads `inflight` (cgpu_report_idle). */
static inline __attribute__((always_inline)) int hold_fast(const _Atomic uint32_t *gate, CUstream stream)
{
    struct gate_slot *s = &slots[0];
    atomic_fetch_add(&s->inflight, 1);
    if (CGPU_UNLIKELY(!(atomic_load(gate) & CGPU_GATE_OPEN))) {
        atomic_fetch_sub_explicit(&s->inflight, 1, memory_order_release);
        return HOLD_NO;
    }
    /* GCC's builtin: the subtraction's own sign flag says "out of line"
     * (C11's fetch_sub returns the old value, tested apart). clang (the
     * packages' zig cc) refuses the builtin on an _Atomic object: there the
     * C11 form, the same operation. */
#if defined(__clang__)
    uint64_t count = atomic_fetch_sub(&s->count, COUNT_STEP) - COUNT_STEP;
#else
    uint64_t count = __atomic_sub_fetch(&s->count, COUNT_STEP, __ATOMIC_SEQ_CST);
#endif
    if (CGPU_UNLIKELY(count >> 63))
        return HOLD_COLD; /* hold_cold tracks the stream */
    track_stream(s, stream);
    return HOLD_YES;
}

/* hold_fast's launch whose count went below zero, holding the grant. An
 * idle report may stand (the bias): it is taken back and the gate looked
 * at again, as hold_open_gate does before its look (cgpud may have closed
 * the gate on the report). Closed: not held; the launch stays in `count`
 * (the safe side: its fence synchronises and says it launched) and the full
 * path waits. Out of credits: the queue drains first. True when held. */
static __attribute__((noinline, cold)) bool hold_cold(struct gate_slot *s, CUstream stream)
{
    take_back_idle(s);
    if (!(atomic_load(g_cgpu.gate[0]) & CGPU_GATE_OPEN)) {
        atomic_fetch_sub_explicit(&s->inflight, 1, memory_order_release);
        return false;
    }
    track_stream(s, stream);
    if (count_left(atomic_load(&s->count)) < 0)
        drain_queue(s, stream);
    return true;
}

/* A launch hook: `params` its parameter list, `stream` (an expression of
 * the parameters) where the launch goes, the rest its arguments.
 *
 * GCC loads every stack-passed argument into a register and stores it back
 * around a tail call that follows a branch (cuLaunchKernel has five), and
 * tail-calls whatever it can. So the hook itself has no branch: it picks,
 * with a mask, the driver (gate ungated) or symbol_gated and jumps there
 * with the arguments untouched. symbol_gated makes exactly one call, not a
 * tail call: the driver holding the open grant (gate_leave after), or
 * symbol_cold (held, count below zero), or symbol_full (gate_enter: init,
 * no watcher yet, several devices, a closed gate, refusals). */
#define GATED_HOOK(symbol, params, stream, ...)                                                 \
    static inline __attribute__((always_inline)) CUresult symbol##_call params                  \
    {                                                                                           \
        GATED_CALL(symbol, stream, __VA_ARGS__);                                                \
    }                                                                                           \
    static __attribute__((noinline, cold)) CUresult symbol##_full params                        \
    {                                                                                           \
        CUresult rc_ = symbol##_call(__VA_ARGS__);                                              \
        publish_open_gate(HOOK_##symbol);                                                       \
        return rc_;                                                                             \
    }                                                                                           \
    static __attribute__((noinline, cold)) CUresult symbol##_cold params                        \
    {                                                                                           \
        if (!hold_cold(&slots[0], (stream)))                                                    \
            return symbol##_full(__VA_ARGS__);                                                  \
        CUresult rc_ = REAL(symbol)(__VA_ARGS__);                                               \
        gate_leave(0);                                                                          \
        return rc_;                                                                             \
    }                                                                                           \
    static __attribute__((noinline)) CUresult symbol##_gated params                             \
    {                                                                                           \
        /* The gate first: published after the driver's pointer was seen, \
         * so that pointer is not NULL whenever the gate can be open.     */ \
        const _Atomic uint32_t *gate_ = atomic_load_explicit(&open_gate[HOOK_##symbol], memory_order_acquire); \
        __typeof__(&symbol) real_ =                                                             \
            (__typeof__(&symbol))atomic_load_explicit(&g_real[HOOK_##symbol], memory_order_relaxed); \
        int held_ = hold_fast(gate_, (stream));                                                 \
        __typeof__(&symbol) fn_ = CGPU_LIKELY(held_ == HOLD_YES) ? real_                          \
                                  : held_ == HOLD_COLD           ? symbol##_cold                \
                                                                 : symbol##_full;               \
        CUresult rc_ = fn_(__VA_ARGS__);                                                        \
        __asm__("" : "+r"(rc_)); /* not a tail call: one call site */                           \
        if (held_ == HOLD_YES)                                                                  \
            gate_leave(0);                                                                      \
        return rc_;                                                                             \
    }                                                                                           \
    CGPU_EXPORT CUresult symbol params                                                          \
    {                                                                                           \
        /* Relaxed: an acquire load here is a compiler barrier that has the \
         * stack arguments loaded before it. Nothing read after depends on \
         * these but the gate word, read through the pointer (a dependency \
         * that orders it on every CPU Linux runs on); a driver pointer    \
         * names code, nothing written.                                   */ \
        const _Atomic uint32_t *gate_ = atomic_load_explicit(&g_cgpu.launch_gate, memory_order_relaxed); \
        uint64_t g_ = atomic_load_explicit(gate_, memory_order_relaxed);                        \
        uintptr_t real_ = (uintptr_t)atomic_load_explicit(&g_real[HOOK_##symbol], memory_order_relaxed); \
        /* Opaque to the optimiser: the mask stays arithmetic (a branch costs \
         * the stack arguments), and computed from a 64-bit value it is a     \
         * shift pair (gate bit 1 to the sign, then spread), no register move. */ \
        __asm__("" : "+r"(g_));                                                                 \
        uintptr_t keep_ = (uintptr_t)0 - ((g_ / CGPU_GATE_UNGATED) & 1); /* all ones if ungated */ \
        uintptr_t to_ = real_ & keep_;                                                          \
        __typeof__(&symbol) fn_ = to_ ? (__typeof__(&symbol))to_ : symbol##_gated;              \
        return fn_(__VA_ARGS__);                                                                \
    }

/* `stream`: where the launch goes (only looked at when draining). */
#define GATED_CALL(symbol, stream, ...)                                                         \
    do {                                                                                        \
        __typeof__(&symbol) real_ = REAL(symbol);                                               \
        if (CGPU_UNLIKELY(!real_))                                                              \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
        CUresult rc_ = CUDA_SUCCESS;                                                            \
        int slot_ = gate_enter(&rc_, (stream));                                                 \
        if (CGPU_LIKELY(slot_ == GATE_FREE))                                                    \
            return real_(__VA_ARGS__);                                                          \
        if (slot_ == GATE_ERROR)                                                                \
            return rc_;                                                                         \
        rc_ = real_(__VA_ARGS__);                                                               \
        gate_leave(slot_);                                                                      \
        return rc_;                                                                             \
    } while (0)

/* The NULL stream of a _ptsz entry point is the thread's own. */
#define LEGACY_NULL(s) (s)
#define PTSZ_NULL(s) ((s) ? (s) : CU_STREAM_PER_THREAD)

#define LAUNCH_HOOK(symbol, null)                                                               \
    GATED_HOOK(symbol,                                                                          \
               (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, \
                unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra),  \
               null(s), f, gx, gy, gz, bx, by, bz, shmem, s, params, extra)

LAUNCH_HOOK(cuLaunchKernel, LEGACY_NULL)
LAUNCH_HOOK(cuLaunchKernel_ptsz, PTSZ_NULL)

GATED_HOOK(cuLaunchKernelEx, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
           config ? config->hStream : NULL, config, f, kernelParams, extra)
GATED_HOOK(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
           PTSZ_NULL(config ? config->hStream : NULL), config, f, kernelParams, extra)

#define COOPERATIVE_HOOK(symbol, null)                                                          \
    GATED_HOOK(symbol,                                                                          \
               (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, \
                unsigned int bz, unsigned int shmem, CUstream s, void **params),                \
               null(s), f, gx, gy, gz, bx, by, bz, shmem, s, params)

COOPERATIVE_HOOK(cuLaunchCooperativeKernel, LEGACY_NULL)
COOPERATIVE_HOOK(cuLaunchCooperativeKernel_ptsz, PTSZ_NULL)

static bool every_gate_ungated(void)
{
    for (unsigned i = 0; i < g_cgpu.device_count; i++)
        if (!(atomic_load_explicit(g_cgpu.gate[i], memory_order_acquire) & CGPU_GATE_UNGATED))
            return false;
    return true;
}

/* A thread waits at one gate at a time, and holding one GPU's grant while
 * waiting for another's would stall the first GPU's fence: a grid over
 * several GPUs of an instance under compute control is refused, as a driver
 * refuses it on GPUs that cannot run it. One GPU is gated like the rest. */
CGPU_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                                          unsigned int numDevices, unsigned int flags)
{
    (void)cgpu_state();
    if (numDevices > 1 && g_cgpu.device_count > 1 && !g_cgpu.launches_refused && !every_gate_ungated())
        return CUDA_ERROR_NOT_SUPPORTED;
    GATED_CALL(cuLaunchCooperativeKernelMultiDevice, launchParamsList && numDevices ? launchParamsList[0].hStream : NULL,
               launchParamsList, numDevices, flags);
}

GATED_HOOK(cuGraphLaunch, (CUgraphExec hGraphExec, CUstream hStream), hStream, hGraphExec, hStream)
GATED_HOOK(cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream), PTSZ_NULL(hStream), hGraphExec, hStream)

/* The deprecated execution-control API: shape and parameters were set on the
 * function beforehand; these run it on the NULL stream. */
GATED_HOOK(cuLaunch, (CUfunction f), NULL, f)
GATED_HOOK(cuLaunchGrid, (CUfunction f, int grid_width, int grid_height), NULL, f, grid_width, grid_height)
GATED_HOOK(cuLaunchGridAsync, (CUfunction f, int grid_width, int grid_height, CUstream hStream), hStream, f,
           grid_width, grid_height, hStream)

/* ---- synchronisation: where an application learns its queue is empty ---------- */

/* The slot to report on once the call returns, with a mark taken before it;
 * -1 when this process launches nothing gated there. */
static inline int idle_watch_begin(uint64_t *mark)
{
    (void)cgpu_state();
    int slot = CGPU_LIKELY(g_cgpu.device_count <= 1) ? 0 : slot_of_current_context();
    if (slot < 0 || (atomic_load_explicit(g_cgpu.gate[slot], memory_order_acquire) & CGPU_GATE_UNGATED) ||
        !atomic_load_explicit(&slots[slot].watched, memory_order_acquire))
        return -1;
    *mark = launch_mark(&slots[slot]);
    return slot;
}

/* Whether a synchronisation of `stream` (QUEUE_ANY: some stream) leaves
 * the process's queue empty: nothing launched since the last fence or
 * drain, or everything into that one stream. One stream of a process that
 * launches into several is no idleness: the others may hold its work, and
 * passed over then, it would wait out a neighbour's slice (and a long
 * kernel of the neighbour's) with its own work still queued. */
static bool queue_in(int slot, uintptr_t stream)
{
    struct gate_slot *s = &slots[slot];
    if (launched_since(s) == 0)
        return true;
    uintptr_t q = atomic_load_explicit(&s->queue_stream, memory_order_relaxed);
    return stream == QUEUE_ANY ? q != QUEUE_MANY : q == stream;
}

#define SYNC_HOOK(symbol, params, stream, ...)                                                  \
    CGPU_EXPORT CUresult symbol params                                                          \
    {                                                                                           \
        __typeof__(&symbol) real_ = REAL(symbol);                                               \
        if (CGPU_UNLIKELY(!real_))                                                              \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
        uint64_t mark_ = 0;                                                                     \
        int slot_ = idle_watch_begin(&mark_);                                                   \
        CUresult rc_ = real_(__VA_ARGS__);                                                      \
        if (slot_ >= 0 && rc_ == CUDA_SUCCESS && queue_in(slot_, (stream)))                     \
            cgpu_report_idle((unsigned)slot_, mark_, false, true);                              \
        return rc_;                                                                             \
    }

SYNC_HOOK(cuStreamSynchronize, (CUstream hStream), (uintptr_t)LEGACY_NULL(hStream), hStream)
SYNC_HOOK(cuStreamSynchronize_ptsz, (CUstream hStream), (uintptr_t)PTSZ_NULL(hStream), hStream)
SYNC_HOOK(cuStreamQuery, (CUstream hStream), (uintptr_t)LEGACY_NULL(hStream), hStream)
SYNC_HOOK(cuStreamQuery_ptsz, (CUstream hStream), (uintptr_t)PTSZ_NULL(hStream), hStream)
SYNC_HOOK(cuEventSynchronize, (CUevent hEvent), QUEUE_ANY, hEvent)
SYNC_HOOK(cuEventQuery, (CUevent hEvent), QUEUE_ANY, hEvent)

CGPU_EXPORT CUresult cuCtxSynchronize(void)
{
    __typeof__(&cuCtxSynchronize) real = REAL(cuCtxSynchronize);
    if (CGPU_UNLIKELY(!real))
        return CUDA_ERROR_NOT_INITIALIZED;
    uint64_t mark = 0;
    int slot = idle_watch_begin(&mark);
    CUresult rc = real();
    if (slot >= 0 && rc == CUDA_SUCCESS)
        cgpu_report_idle((unsigned)slot, mark, true, true);
    return rc;
}

/* CUDA 13's form, which cudaDeviceSynchronize goes through: the same idle
 * report when the context waited for is the calling thread's. */
CGPU_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    __typeof__(&cuCtxSynchronize_v2) real = REAL(cuCtxSynchronize_v2);
    __typeof__(&cuCtxGetCurrent) current = REAL(cuCtxGetCurrent);
    if (CGPU_UNLIKELY(!real))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext cur = NULL;
    uint64_t mark = 0;
    int slot = -1;
    if (!ctx || (current && current(&cur) == CUDA_SUCCESS && cur == ctx))
        slot = idle_watch_begin(&mark);
    CUresult rc = real(ctx);
    if (slot >= 0 && rc == CUDA_SUCCESS)
        cgpu_report_idle((unsigned)slot, mark, true, true);
    return rc;
}
