/* cgpu-sim-stat: the simulated GPUs' shared state as one JSON object, for
 * tests and for people looking at a demo; and the faults a test injects.
 *
 *   cgpu-sim-stat                              GPUs, live processes, now_ns
 *   cgpu-sim-stat --busy GPU FROM TO           device busy ns in [FROM, TO)
 *   cgpu-sim-stat --sample GPU INTERVAL_MS N   N JSON lines, one per interval
 *   cgpu-sim-stat --xid GPU XID                the GPU reports an XID (NVML event)
 *   cgpu-sim-stat --lost GPU                   the GPU falls off the bus (XID 79)
 *   cgpu-sim-stat --recover GPU                the GPU is back (a reset)
 *
 * A fault prints the GPU's state as {"index", "lost", "xids"}.
 * Times are CLOCK_MONOTONIC ns, the clock of the state's records. Reaps dead
 * processes first, as any user of the state may. Exit 1 if the state cannot
 * be attached, 2 on a usage error; one line on stderr either way. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simstate.h"

static void json_string(const char *s, size_t max)
{
    putchar('"');
    for (size_t i = 0; i < max && s[i]; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c >= 0x7f) /* comm is any bytes: keep the output ASCII */
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

/* The slot's owner holds its lock while it lives; F_OFD_GETLK asks without
 * taking it. */
static int slot_alive(int fd, int slot)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SIM_SLOT_LOCK_OFFSET(slot), .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return 1;
    return fl.l_type != F_UNLCK;
}

/* The pid of a process known by its records, as the caller's namespace sees
 * it: through its slot while it lives, else only if it was of the caller's
 * own namespace (the pid of a process gone from another namespace is lost,
 * as a real driver's is); 0 when unknown or not visible. */
static int32_t record_pid(const struct sim_handle *h, const struct sim_pid_busy *r, uint64_t self_ns)
{
    if (r->pidns == 0 || r->pidns == self_ns)
        return r->pid;
    const struct sim_proc_slot *s = &h->st->proc[r->slot % SIM_MAX_PROCS];
    if (atomic_load(&s->state) != SIM_SLOT_LIVE || atomic_load(&s->generation) != r->generation)
        return 0;
    int32_t pid = sim_slot_pid(h, (int)(r->slot % SIM_MAX_PROCS), self_ns);
    return atomic_load(&s->generation) == r->generation ? pid : 0;
}

static void print_state(struct sim_handle *h)
{
    const struct sim_state *st = h->st;
    uint64_t self_ns = sim_pidns_self();
    unsigned int ngpu = st->config.gpu_count < SIM_MAX_GPUS ? st->config.gpu_count : SIM_MAX_GPUS;
    printf("{\"gpus\":[");
    for (unsigned int g = 0; g < ngpu; g++) {
        const struct sim_gpu_config *c = &st->config.gpu[g];
        printf("%s{\"index\":%u,\"uuid\":", g ? "," : "", g);
        json_string(c->uuid, sizeof(c->uuid));
        printf(",\"name\":");
        json_string(c->name, sizeof(c->name));
        printf(",\"total\":%" PRIu64 ",\"used\":%" PRIu64 ",\"busy_total_ns\":%" PRIu64
               ",\"lost\":%s,\"xids\":%" PRIu64 "}",
               c->total_mem, atomic_load(&st->gpu[g].used), atomic_load(&st->gpu[g].busy_total),
               sim_gpu_lost(st, (int)g) ? "true" : "false", atomic_load(&st->gpu[g].fault.xid_head));
    }
    printf("],\"procs\":[");
    int first = 1;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        const struct sim_proc_slot *s = &st->proc[i];
        if (atomic_load(&s->state) != SIM_SLOT_LIVE)
            continue;
        char comm[sizeof(s->comm)];
        memcpy(comm, s->comm, sizeof(comm));
        /* pid: in our namespace (0 if not visible from it); ns_pid: in its own. */
        printf("%s{\"slot\":%d,\"pid\":%" PRId32 ",\"ns_pid\":%" PRId32 ",\"comm\":", first ? "" : ",", i,
               sim_slot_pid(h, i, self_ns), atomic_load(&s->pid));
        json_string(comm, sizeof(comm));
        printf(",\"alive\":%s,\"used\":[", slot_alive(h->fd, i) ? "true" : "false");
        for (unsigned int g = 0; g < ngpu; g++)
            printf("%s%" PRIu64, g ? "," : "", atomic_load(&s->used[g]));
        printf("],\"busy_ns\":[");
        for (unsigned int g = 0; g < ngpu; g++)
            printf("%s%" PRIu64, g ? "," : "", atomic_load(&s->busy_ns[g]));
        printf("]}");
        first = 0;
    }
    printf("],\"now_ns\":%" PRIu64 "}\n", sim_now_ns());
}

/* per_pid: by pid in our namespace; processes not visible from it (or gone
 * from another namespace) count in busy_ns only. */
static void print_busy(const struct sim_handle *h, int gpu, uint64_t from, uint64_t to)
{
    static struct sim_pid_busy per[SIM_MAX_PROCS];
    uint64_t busy, self_ns = sim_pidns_self();
    int n, out = 0;
    bool complete = sim_busy_between(h->st, gpu, from, to, &busy, per, SIM_MAX_PROCS, &n);
    for (int i = 0; i < n; i++) {
        int32_t pid = record_pid(h, &per[i], self_ns);
        int k = 0;
        while (k < out && per[k].pid != pid)
            k++;
        if (pid == 0)
            continue;
        if (k < out) {
            per[k].ns += per[i].ns;
        } else {
            per[out] = per[i];
            per[out++].pid = pid;
        }
    }
    printf("{\"busy_ns\":%" PRIu64 ",\"per_pid\":{", busy);
    for (int i = 0; i < out; i++)
        printf("%s\"%d\":%" PRIu64, i ? "," : "", (int)per[i].pid, per[i].ns);
    printf("},\"complete\":%s}\n", complete ? "true" : "false");
}

/* ---- --sample: device time each process has completed, over time --------
 *
 * A process's busy counter is charged when it reserves device time, up to a
 * few ms ahead of now; the part of its execution records after now is
 * subtracted to get what it has completed by now. Slots are reused: a claim
 * resets the counter and bumps the generation, so the sampler follows each
 * (slot, generation) and sums them by pid as the sampler's pid namespace
 * sees it (sim_slot_pid; processes not visible from it are left out). A
 * process whose slot was claimed again between two samples ends at its last
 * value plus what the ring shows it ran since (kept pending while any of it
 * lies in the future); the ring holds SIM_RING records, seconds of a
 * saturated GPU, so that recovery is exact unless the ring wrapped within
 * one interval. */

#define QUIET_RECORDS 64 /* consecutive records ending before the span: stop */

struct slot_view {
    bool observed; /* gen, pid and t_obs hold a consistent reading */
    bool tracked;  /* that entity has run on the GPU: pidx and value are valid */
    bool fresh;    /* read consistently in this sample */
    bool gap;      /* claimed again since t_obs: recover the ring since gap_t */
    int32_t pid; /* in the owner's namespace */
    int pidx;
    uint64_t gen, t_obs, gap_t;
    uint64_t hidden_gen; /* that entity is not visible from our namespace: not asked again */
    uint64_t counter; /* busy_ns[gpu] in this sample */
    uint64_t future;  /* its reserved work after now, from the ring */
    uint64_t value;   /* device time completed by t_obs; never decreases */
    /* The last reading whose counter did not move while the ring was read:
     * the base a retired entity continues from (0 time: none yet). */
    uint64_t vbase, vbase_t;
};

struct retired {
    int slot;
    uint64_t gen;
    int pidx;
    uint64_t base, t_base; /* completed by t_base */
    uint64_t tail;         /* its device time in [t_base, now) */
    bool future;           /* some of its work lies after now */
};

struct pid_row {
    int32_t pid; /* in the sampler's namespace */
    uint64_t done; /* final totals of its processes that are gone */
    uint64_t cur;  /* this sample's total */
    uint64_t out;  /* the last value printed: never decreases */
};

struct sampler {
    const struct sim_handle *h;
    const struct sim_state *st;
    uint64_t self_ns;
    int gpu;
    uint64_t stop_t; /* the ring is needed back to here */
    uint64_t busy_out;
    struct slot_view slot[SIM_MAX_PROCS];
    struct pid_row *pids;
    int npids, cap_pids;
    struct retired *ret;
    int nret, cap_ret;
    char *line;
    size_t cap_line;
};

static void *grow(void *p, size_t elem, int *cap)
{
    int n = *cap ? *cap * 2 : 16;
    void *q = realloc(p, elem * (size_t)n);
    if (!q) {
        fprintf(stderr, "cgpu-sim-stat: out of memory\n");
        exit(1);
    }
    *cap = n;
    return q;
}

static int pid_index(struct sampler *sm, int32_t pid)
{
    for (int i = 0; i < sm->npids; i++)
        if (sm->pids[i].pid == pid)
            return i;
    if (sm->npids == sm->cap_pids)
        sm->pids = grow(sm->pids, sizeof(*sm->pids), &sm->cap_pids);
    sm->pids[sm->npids] = (struct pid_row){.pid = pid};
    return sm->npids++;
}

static struct retired *retire(struct sampler *sm, int slot, uint64_t gen, int pidx, uint64_t base, uint64_t t_base)
{
    if (sm->nret == sm->cap_ret)
        sm->ret = grow(sm->ret, sizeof(*sm->ret), &sm->cap_ret);
    struct retired *r = &sm->ret[sm->nret++];
    *r = (struct retired){.slot = slot, .gen = gen, .pidx = pidx, .base = base, .t_base = t_base};
    if (t_base < sm->stop_t)
        sm->stop_t = t_base;
    return r;
}

/* One consistent reading of every slot: a claim in progress (state CLAIMING,
 * or the generation moving under us) leaves the slot as last seen. */
static void read_slots(struct sampler *sm, uint64_t now)
{
    const struct sim_state *st = sm->st;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        const struct sim_proc_slot *s = &st->proc[i];
        struct slot_view *v = &sm->slot[i];
        v->fresh = v->gap = false;
        uint32_t state = atomic_load(&s->state);
        uint64_t gen = atomic_load(&s->generation);
        if (gen == 0) { /* never claimed */
            v->observed = true;
            v->gen = 0;
            v->t_obs = now;
            continue;
        }
        if (state == SIM_SLOT_CLAIMING)
            continue;
        int32_t pid = atomic_load(&s->pid);
        uint64_t counter = atomic_load(&s->busy_ns[sm->gpu]);
        uint32_t mask = atomic_load(&s->gpu_mask);
        if (atomic_load(&s->generation) != gen || atomic_load(&s->state) == SIM_SLOT_CLAIMING)
            continue;
        if (v->observed && gen != v->gen) {
            v->gap = true;
            v->gap_t = v->t_obs;
            if (v->gap_t < sm->stop_t)
                sm->stop_t = v->gap_t;
            if (v->tracked && v->vbase_t)
                retire(sm, i, v->gen, v->pidx, v->vbase, v->vbase_t);
            else if (v->tracked)
                retire(sm, i, v->gen, v->pidx, v->value, v->t_obs);
            v->tracked = false;
        }
        v->observed = true;
        v->gen = gen;
        v->t_obs = now;
        if (!v->tracked) {
            v->pid = pid;
            if ((counter == 0 && !(state == SIM_SLOT_LIVE && (mask >> sm->gpu) & 1u)) || v->hidden_gen == gen)
                continue; /* not a process of this GPU (yet), or hidden */
            /* Named once, while it lives: its pid as we see it. */
            int32_t seen = sim_slot_pid(sm->h, i, sm->self_ns);
            if (atomic_load(&s->generation) != gen)
                continue;
            if (seen == 0) { /* not visible from our namespace */
                v->hidden_gen = gen;
                continue;
            }
            v->tracked = true;
            v->pidx = pid_index(sm, seen);
            v->value = v->vbase = v->vbase_t = 0;
        }
        v->fresh = true;
        v->counter = counter;
        v->future = 0;
    }
}

/* A record of a process that is gone, or of one that came and went between
 * two samples on a slot claimed again since. */
static void attribute_past(struct sampler *sm, const struct sim_pid_busy *who, uint64_t s, uint64_t e, uint64_t now,
                           uint64_t pct)
{
    struct retired *r = NULL;
    uint32_t slot = who->slot;
    for (int i = 0; i < sm->nret && !r; i++)
        if (sm->ret[i].slot == (int)slot && sm->ret[i].gen == who->generation)
            r = &sm->ret[i];
    if (!r) {
        const struct slot_view *v = &sm->slot[slot];
        if (!v->gap || who->generation == v->gen || e <= v->gap_t)
            return;
        /* Never seen alive: its recorded pid is ours only if it shared our
         * namespace; else its time counts in busy_ns alone. */
        if (who->pidns != 0 && who->pidns != sm->self_ns)
            return;
        r = retire(sm, (int)slot, who->generation, pid_index(sm, who->pid), 0, v->gap_t);
    }
    if (e <= r->t_base)
        return;
    uint64_t lo = s > r->t_base ? s : r->t_base, hi = e < now ? e : now;
    if (hi > lo)
        r->tail += (hi - lo) * pct / 100;
    if (e > now)
        r->future = true;
}

/* Newest records first, until QUIET_RECORDS in a row end before stop_t
 * (records are published in nearly the order of the timeline); bounded by the
 * ring. Returns the whole GPU's reserved work after now. */
static uint64_t scan_ring(struct sampler *sm, uint64_t now)
{
    const struct sim_gpu_live *g = &sm->st->gpu[sm->gpu];
    for (int i = 0; i < sm->nret; i++) {
        sm->ret[i].tail = 0;
        sm->ret[i].future = false;
    }
    uint64_t head = atomic_load(&g->ring_head);
    uint64_t n = head < SIM_RING ? head : SIM_RING, all = 0;
    int quiet = 0;
    for (uint64_t k = 0; k < n && quiet < QUIET_RECORDS; k++) {
        uint64_t idx = head - 1 - k;
        const struct sim_exec_record *r = &g->ring[idx % SIM_RING];
        if (atomic_load_explicit(&r->seq, memory_order_acquire) != idx + 1)
            continue; /* being written: its owner has not charged it yet */
        uint64_t s = atomic_load(&r->start_ns), e = atomic_load(&r->end_ns), pct = atomic_load(&r->pct);
        struct sim_pid_busy who = {.pid = atomic_load(&r->pid),
                                   .slot = atomic_load(&r->slot),
                                   .generation = atomic_load(&r->generation),
                                   .pidns = atomic_load(&r->pidns)};
        uint32_t slot = who.slot;
        if (atomic_load(&r->seq) != idx + 1)
            continue;
        pct = pct > 100 ? 100 : pct; /* an MPS client's stretch is that part of the GPU's work */
        if (e > now) {
            uint64_t f = (e - (s > now ? s : now)) * pct / 100;
            all += f;
            if (slot < SIM_MAX_PROCS && sm->slot[slot].fresh && sm->slot[slot].gen == who.generation)
                sm->slot[slot].future += f;
        }
        if (e > sm->stop_t && slot < SIM_MAX_PROCS && (sm->nret || sm->slot[slot].gap))
            attribute_past(sm, &who, s, e, now, pct);
        quiet = e <= sm->stop_t ? quiet + 1 : 0;
    }
    return all;
}

static char *put_u64(char *p, uint64_t v)
{
    char tmp[20];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = tmp[--n];
    return p;
}

static char *put_str(char *p, const char *s)
{
    size_t n = strlen(s);
    memcpy(p, s, n);
    return p + n;
}

/* One sample as one line in sm->line; returns its length. */
static size_t sample_once(struct sampler *sm)
{
    uint64_t now = sim_now_ns();
    /* Charged before read: busy_total after each process's counter, and a
     * counter after its record, so every charge read here has its record in
     * the ring (a record whose charge is not read yet can only make a value
     * momentarily low, which the monotonic outputs absorb). */
    uint64_t total = atomic_load(&sm->st->gpu[sm->gpu].busy_total);
    sm->stop_t = now;
    for (int i = 0; i < sm->nret; i++)
        if (sm->ret[i].t_base < sm->stop_t)
            sm->stop_t = sm->ret[i].t_base;
    read_slots(sm, now);
    uint64_t future = scan_ring(sm, now);

    for (int i = 0; i < sm->nret;) {
        struct retired *r = &sm->ret[i];
        if (r->future) {
            i++;
        } else { /* all done: its final total */
            sm->pids[r->pidx].done += r->base + r->tail;
            *r = sm->ret[--sm->nret];
        }
    }
    for (int i = 0; i < sm->npids; i++)
        sm->pids[i].cur = sm->pids[i].done;
    for (int i = 0; i < sm->nret; i++)
        sm->pids[sm->ret[i].pidx].cur += sm->ret[i].base + sm->ret[i].tail;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct slot_view *v = &sm->slot[i];
        if (!v->tracked)
            continue;
        if (v->fresh) {
            uint64_t done = v->counter > v->future ? v->counter - v->future : 0;
            if (done > v->value)
                v->value = done;
            /* A record published before its charge (the reserver is between
             * the two) makes `done` low; the charge nearly always lands while
             * the ring is read, so a counter that did not move vouches for it. */
            const struct sim_proc_slot *s = &sm->st->proc[i];
            if (atomic_load(&s->busy_ns[sm->gpu]) == v->counter && atomic_load(&s->generation) == v->gen) {
                v->vbase = done;
                v->vbase_t = v->t_obs;
            }
        }
        sm->pids[v->pidx].cur += v->value;
    }
    uint64_t busy = total > future ? total - future : 0;
    if (busy > sm->busy_out)
        sm->busy_out = busy;

    size_t need = 128 + (size_t)sm->npids * 48;
    if (need > sm->cap_line) {
        char *q = realloc(sm->line, need);
        if (!q) {
            fprintf(stderr, "cgpu-sim-stat: out of memory\n");
            exit(1);
        }
        sm->line = q;
        sm->cap_line = need;
    }
    char *p = put_str(sm->line, "{\"now_ns\":");
    p = put_u64(p, now);
    p = put_str(p, ",\"busy_ns\":");
    p = put_u64(p, sm->busy_out);
    p = put_str(p, ",\"per_pid\":{");
    for (int i = 0; i < sm->npids; i++) {
        struct pid_row *row = &sm->pids[i];
        if (row->cur > row->out)
            row->out = row->cur;
        if (i)
            *p++ = ',';
        *p++ = '"';
        if (row->pid < 0) {
            *p++ = '-';
            p = put_u64(p, (uint64_t)-(int64_t)row->pid);
        } else {
            p = put_u64(p, (uint64_t)row->pid);
        }
        p = put_str(p, "\":");
        p = put_u64(p, row->out);
    }
    p = put_str(p, "}}\n");
    return (size_t)(p - sm->line);
}

/* Sleep until t_ns with SIGTERM and SIGINT let in only while waiting (they
 * are blocked otherwise, so a line is never cut). False once one arrived. */
static volatile sig_atomic_t stop_requested;

static void on_stop(int sig)
{
    (void)sig;
    stop_requested = 1;
}

static bool wait_until(uint64_t t_ns, const sigset_t *waitmask)
{
    while (!stop_requested) {
        uint64_t now = sim_now_ns();
        if (now >= t_ns)
            return true;
        uint64_t left = t_ns - now;
        struct timespec ts = {.tv_sec = (time_t)(left / 1000000000ULL), .tv_nsec = (long)(left % 1000000000ULL)};
        (void)ppoll(NULL, 0, &ts, waitmask);
    }
    return false;
}

static int run_sample(const struct sim_handle *h, int gpu, uint64_t interval_ms, uint64_t count)
{
    sigset_t block, waitmask;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &waitmask);
    sigdelset(&waitmask, SIGTERM);
    sigdelset(&waitmask, SIGINT);
    struct sigaction sa = {.sa_handler = on_stop};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    static struct sampler sm;
    sm.h = h;
    sm.st = h->st;
    sm.self_ns = sim_pidns_self();
    sm.gpu = gpu;
    uint64_t interval = interval_ms * 1000000ULL, next = sim_now_ns();
    int rc = 0;
    for (uint64_t k = 0; count == 0 || k < count; k++) {
        if (!wait_until(next, &waitmask))
            break;
        size_t len = sample_once(&sm);
        if (fwrite(sm.line, 1, len, stdout) != len || fflush(stdout) != 0) {
            rc = 1;
            break;
        }
        /* Absolute deadlines: no drift; a deadline already missed is
         * skipped rather than caught up with a burst. */
        next += interval;
        uint64_t now = sim_now_ns();
        if (next <= now)
            next += ((now - next) / interval + 1) * interval;
    }
    free(sm.pids);
    free(sm.ret);
    free(sm.line);
    return rc;
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end != '\0' || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static void print_fault(const struct sim_state *st, int gpu)
{
    printf("{\"index\":%d,\"lost\":%s,\"xids\":%" PRIu64 "}\n", gpu, sim_gpu_lost(st, gpu) ? "true" : "false",
           atomic_load(&st->gpu[gpu].fault.xid_head));
}

int main(int argc, char **argv)
{
    uint64_t gpu = 0, from = 0, to = 0, interval_ms = 0, count = 0, xid = 0;
    const char *mode = argc > 1 ? argv[1] : "";
    int busy = strcmp(mode, "--busy") == 0, sample = strcmp(mode, "--sample") == 0;
    int fault_xid = strcmp(mode, "--xid") == 0, lost = strcmp(mode, "--lost") == 0;
    int recover = strcmp(mode, "--recover") == 0;
    if ((argc != 1 && !busy && !sample && !fault_xid && !lost && !recover) ||
        (busy && (argc != 5 || parse_u64(argv[2], &gpu) || parse_u64(argv[3], &from) || parse_u64(argv[4], &to))) ||
        (sample && (argc != 5 || parse_u64(argv[2], &gpu) || parse_u64(argv[3], &interval_ms) ||
                    parse_u64(argv[4], &count) || interval_ms == 0 || interval_ms > UINT64_MAX / 2000000ULL)) ||
        /* NVML reports 999 for an XID it cannot name: any number up to that. */
        (fault_xid && (argc != 4 || parse_u64(argv[2], &gpu) || parse_u64(argv[3], &xid) || xid == 0 || xid > 999)) ||
        ((lost || recover) && (argc != 3 || parse_u64(argv[2], &gpu)))) {
        fprintf(stderr, "usage: cgpu-sim-stat [--busy GPU FROM_NS TO_NS | --sample GPU INTERVAL_MS COUNT | "
                        "--xid GPU XID(1-999) | --lost GPU | --recover GPU]\n");
        return 2;
    }
    struct sim_handle h;
    char err[512];
    if (sim_attach(&h, err, sizeof(err)) != 0) {
        fprintf(stderr, "cgpu-sim-stat: %s\n", err);
        return 1;
    }
    if (argc > 2 && gpu >= h.st->config.gpu_count) {
        fprintf(stderr, "cgpu-sim-stat: no GPU %" PRIu64 ": the machine has %u\n", gpu, h.st->config.gpu_count);
        sim_detach(&h);
        return 2;
    }
    sim_reap_dead(&h);
    int rc = 0;
    if (fault_xid || lost || recover) {
        if (fault_xid)
            sim_fault_xid(h.st, (int)gpu, xid);
        else
            sim_fault_set_lost(h.st, (int)gpu, lost);
        print_fault(h.st, (int)gpu);
    } else if (sample)
        rc = run_sample(&h, (int)gpu, interval_ms, count);
    else if (busy)
        print_busy(&h, (int)gpu, from, to);
    else
        print_state(&h);
    sim_detach(&h);
    return fflush(stdout) == 0 ? rc : 1;
}
