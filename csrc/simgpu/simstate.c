/* The shared state file of the simulated GPUs: creation, process slots,
 * memory charging, the device timeline. See simstate.h for the contract. */
#define _GNU_SOURCE
#include "simstate.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

uint64_t sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* A real driver's synchronisation returns once the work is done (it spins
 * or yields by default); with the thread's default 50 us of timer slack a
 * sleep here would end up to that much later. The caller's slack is put back. */
void sim_sleep_until(uint64_t t_ns)
{
    if (t_ns <= sim_now_ns())
        return; /* spares the timer-slack calls when the work is already done */
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ULL), .tv_nsec = (long)(t_ns % 1000000000ULL)};
    int slack = prctl(PR_GET_TIMERSLACK, 0UL, 0UL, 0UL, 0UL);
    if (slack > 1)
        prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
    if (slack > 1)
        prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0UL, 0UL, 0UL);
}

static uint64_t fnv1a(const void *data, size_t len)
{
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* A byte-range lock on the open file description, not the process: closing
 * another descriptor of the file does not drop it, and the kernel drops it
 * when the process dies. */
static int slot_lock(int fd, int slot, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = SIM_SLOT_LOCK_OFFSET(slot), .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

static int create_state(const char *path, const struct sim_config *cfg, uint64_t hash, char *err, size_t errlen)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.XXXXXX", path) >= (int)sizeof(tmp)) {
        snprintf(err, errlen, "simulated GPU state path too long: %s", path);
        return -1;
    }
    /* Not named by pid: processes of two pid namespaces may both be pid 1. */
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create simulated GPU state %s: %s", tmp, strerror(errno));
        return -1;
    }
    /* Any user of this machine may use its GPUs, as with /dev/nvidia*. */
    (void)fchmod(fd, 0666);
    size_t size = sizeof(struct sim_state);
    struct sim_state *st = MAP_FAILED;
    if (ftruncate(fd, (off_t)size) == 0)
        st = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (st == MAP_FAILED) {
        snprintf(err, errlen, "cannot size simulated GPU state %s: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        return -1;
    }
    st->version = SIM_VERSION;
    st->size = (uint32_t)size;
    st->config_hash = hash;
    st->config = *cfg;
    st->magic = SIM_MAGIC;
    munmap(st, size);
    close(fd);
    /* link() publishes the fully written file or fails if another process
     * already published one: nobody ever sees a half-initialised state. */
    int rc = link(tmp, path);
    int saved = errno;
    unlink(tmp);
    if (rc != 0 && saved != EEXIST) {
        snprintf(err, errlen, "cannot publish simulated GPU state %s: %s", path, strerror(saved));
        return -1;
    }
    return 0;
}

int sim_attach(struct sim_handle *h, char *err, size_t errlen)
{
    struct sim_config cfg;
    if (sim_config_load(getenv(SIM_ENV_CONFIG), &cfg, err, errlen))
        return -1;
    uint64_t hash = fnv1a(&cfg, sizeof(cfg));
    const char *path = getenv(SIM_ENV_STATE);
    if (!path || !*path)
        path = SIM_DEFAULT_STATE;

    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
        if (create_state(path, &cfg, hash, err, errlen))
            return -1;
        fd = open(path, O_RDWR | O_CLOEXEC);
    }
    if (fd < 0) {
        snprintf(err, errlen, "cannot open simulated GPU state %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    if (fstat(fd, &sb) || (size_t)sb.st_size != sizeof(struct sim_state)) {
        snprintf(err, errlen, "simulated GPU state %s has the wrong size; run 'cgpuctl sim reset'", path);
        close(fd);
        return -1;
    }
    struct sim_state *st = mmap(NULL, sizeof(*st), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (st == MAP_FAILED) {
        snprintf(err, errlen, "cannot map simulated GPU state %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (st->magic != SIM_MAGIC || st->version != SIM_VERSION) {
        snprintf(err, errlen, "%s is not a simulated GPU state of this version; run 'cgpuctl sim reset'", path);
        munmap(st, sizeof(*st));
        close(fd);
        return -1;
    }
    if (st->config_hash != hash) {
        snprintf(err, errlen,
                 "simulated GPU state %s was made for another configuration; "
                 "run 'cgpuctl sim reset' or point %s elsewhere",
                 path, SIM_ENV_STATE);
        munmap(st, sizeof(*st));
        close(fd);
        return -1;
    }
    h->st = st;
    h->fd = fd;
    h->slot = -1;
    pthread_mutex_init(&h->reap_lock, NULL);
    return 0;
}

void sim_detach(struct sim_handle *h)
{
    /* reap_lock is left alone: a forked child detaches while another
     * thread of its parent may have held it, and sim_attach re-creates it. */
    if (h->st)
        munmap(h->st, sizeof(*h->st));
    if (h->fd >= 0)
        close(h->fd);
    h->st = NULL;
    h->fd = -1;
    h->slot = -1;
}

/* Give back everything a dead process held. The caller holds the slot's lock;
 * the LIVE->FREE exchange makes exactly one caller do the work. */
static void release_slot(struct sim_state *st, int i)
{
    struct sim_proc_slot *s = &st->proc[i];
    for (unsigned g = 0; g < SIM_MAX_GPUS; g++) {
        uint64_t held = atomic_exchange(&s->used[g], 0);
        if (held)
            atomic_fetch_sub(&st->gpu[g].used, held);
    }
}

int sim_reap_dead(struct sim_handle *h)
{
    int reaped = 0;
    pthread_mutex_lock(&h->reap_lock);
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc_slot *s = &h->st->proc[i];
        if (i == h->slot || atomic_load(&s->state) != SIM_SLOT_LIVE)
            continue;
        if (slot_lock(h->fd, i, F_WRLCK) != 0)
            continue; /* owner alive */
        uint32_t live = SIM_SLOT_LIVE;
        if (atomic_compare_exchange_strong(&s->state, &live, SIM_SLOT_CLAIMING)) {
            release_slot(h->st, i);
            atomic_store(&s->gpu_mask, 0);
            atomic_store(&s->state, SIM_SLOT_FREE);
            reaped++;
        }
        slot_lock(h->fd, i, F_UNLCK);
    }
    pthread_mutex_unlock(&h->reap_lock);
    return reaped;
}

static int claim_free_slot(struct sim_handle *h);

int sim_claim_slot(struct sim_handle *h)
{
    pthread_mutex_lock(&h->reap_lock);
    int rc = h->slot >= 0 ? 0 : claim_free_slot(h);
    pthread_mutex_unlock(&h->reap_lock);
    return rc;
}

static int claim_free_slot(struct sim_handle *h)
{
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        struct sim_proc_slot *s = &h->st->proc[i];
        if (slot_lock(h->fd, i, F_WRLCK) != 0)
            continue;
        /* Holding the lock: the slot is free, or its owner died. */
        uint32_t cur = atomic_load(&s->state);
        if (cur != SIM_SLOT_CLAIMING && !atomic_compare_exchange_strong(&s->state, &cur, SIM_SLOT_CLAIMING)) {
            slot_lock(h->fd, i, F_UNLCK);
            continue;
        }
        if (cur != SIM_SLOT_FREE) /* a live or half-claimed slot whose owner died */
            release_slot(h->st, i);
        for (unsigned g = 0; g < SIM_MAX_GPUS; g++) {
            atomic_store(&s->busy_ns[g], 0);
            atomic_store(&s->mps_lane[g], 0);
            atomic_store(&s->mps_mem_limit[g], 0);
        }
        atomic_store(&s->gpu_mask, 0);
        atomic_store(&s->mps_role, SIM_MPS_NONE);
        atomic_store(&s->mps_pct, 100);
        atomic_store(&s->mps_server, -1);
        atomic_store(&s->mps_server_gen, 0);
        /* Best effort: without the pid lock readers fall back to /proc. */
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SIM_SLOT_PID_OFFSET(i), .l_len = 1};
        (void)fcntl(h->fd, F_SETLK, &fl);
        atomic_store(&s->pid, (int32_t)getpid());
        atomic_store(&s->pidns, sim_pidns_self());
        memset(s->comm, 0, sizeof(s->comm));
        (void)prctl(PR_GET_NAME, s->comm, 0, 0, 0);
        s->comm[sizeof(s->comm) - 1] = '\0';
        atomic_fetch_add(&s->generation, 1);
        atomic_store(&s->state, SIM_SLOT_LIVE);
        h->slot = i;
        return 0;
    }
    return -1;
}

bool sim_mem_charge(struct sim_handle *h, int gpu, uint64_t bytes)
{
    struct sim_gpu_live *g = &h->st->gpu[gpu];
    uint64_t total = h->st->config.gpu[gpu].total_mem;
    /* An MPS client's pinned device memory limit: what it holds on the GPU
     * (its context's memory too) stays within it. Only the process itself
     * charges its slot, so the check cannot race with another charger. */
    const struct sim_proc_slot *me = &h->st->proc[h->slot];
    uint64_t limit = atomic_load(&me->mps_mem_limit[gpu]), mine = atomic_load(&me->used[gpu]);
    if (limit && (bytes > limit || mine > limit - bytes))
        return false;
    for (int attempt = 0; attempt < 2; attempt++) {
        uint64_t cur = atomic_load(&g->used);
        while (bytes <= total && cur <= total - bytes) {
            if (atomic_compare_exchange_weak(&g->used, &cur, cur + bytes)) {
                atomic_fetch_add(&h->st->proc[h->slot].used[gpu], bytes);
                return true;
            }
        }
        if (attempt == 0 && sim_reap_dead(h) == 0)
            break;
    }
    return false;
}

void sim_mem_release(struct sim_handle *h, int gpu, uint64_t bytes)
{
    atomic_fetch_sub(&h->st->proc[h->slot].used[gpu], bytes);
    atomic_fetch_sub(&h->st->gpu[gpu].used, bytes);
}

/* How far back a process looks for its own latest stretch to extend: MPS
 * clients' stretches interleave in the ring. */
#define SIM_EXTEND_LOOKBACK 8

static void record_exec(struct sim_handle *h, int gpu, uint64_t start, uint64_t end, uint32_t pct)
{
    struct sim_gpu_live *g = &h->st->gpu[gpu];
    uint64_t head = atomic_load(&g->ring_head);
    for (uint64_t k = 1; k <= SIM_EXTEND_LOOKBACK && k <= head; k++) {
        struct sim_exec_record *last = &g->ring[(head - k) % SIM_RING];
        if (atomic_load(&last->seq) != head - k + 1 || atomic_load(&last->slot) != (uint32_t)h->slot)
            continue;
        uint64_t expect = start;
        /* Contiguous with our own latest stretch at the same part of the
         * SMs: extend it, keeping the ring long enough to cover a
         * saturating tenant for seconds. */
        if (atomic_load(&last->pct) == pct && atomic_compare_exchange_strong(&last->end_ns, &expect, end))
            return;
        break; /* our latest stretch, and it does not continue */
    }
    uint64_t idx = atomic_fetch_add(&g->ring_head, 1);
    struct sim_exec_record *r = &g->ring[idx % SIM_RING];
    atomic_store(&r->seq, 0);
    atomic_store(&r->start_ns, start);
    atomic_store(&r->end_ns, end);
    atomic_store(&r->slot, (uint32_t)h->slot);
    atomic_store(&r->pct, pct);
    const struct sim_proc_slot *owner = &h->st->proc[h->slot];
    atomic_store(&r->pid, atomic_load(&owner->pid));
    atomic_store(&r->generation, atomic_load(&owner->generation));
    atomic_store(&r->pidns, atomic_load(&owner->pidns));
    atomic_store_explicit(&r->seq, idx + 1, memory_order_release);
}

/* ---- MPS --------------------------------------------------------------------- */

int sim_use_gpu(struct sim_handle *h, int gpu, uint64_t ctx_bytes)
{
    struct sim_proc_slot *me = &h->st->proc[h->slot];
    uint32_t bit = 1u << gpu;
    if (atomic_load(&me->gpu_mask) & bit)
        return 0;
    uint32_t mode = atomic_load(&h->st->gpu[gpu].compute_mode);
    if (mode == SIM_COMPUTEMODE_PROHIBITED)
        return -2;
    if (ctx_bytes && !sim_mem_charge(h, gpu, ctx_bytes))
        return -1;
    /* Mark first, then look: of two processes racing for an exclusive GPU
     * at least one sees the other, so never both get it. */
    atomic_fetch_or(&me->gpu_mask, bit);
    if (mode == SIM_COMPUTEMODE_EXCLUSIVE_PROCESS || mode == SIM_COMPUTEMODE_EXCLUSIVE_THREAD) {
        sim_reap_dead(h);
        for (int i = 0; i < SIM_MAX_PROCS; i++) {
            if (sim_excludes(h->st, h->slot, i, gpu)) {
                atomic_fetch_and(&me->gpu_mask, ~bit);
                if (ctx_bytes)
                    sim_mem_release(h, gpu, ctx_bytes);
                return -2;
            }
        }
    }
    return 0;
}

bool sim_mps_client_live(const struct sim_state *st, int i)
{
    const struct sim_proc_slot *c = &st->proc[i];
    if (atomic_load(&c->mps_role) != SIM_MPS_CLIENT)
        return false;
    int32_t srv = atomic_load(&c->mps_server);
    if (srv < 0 || srv >= SIM_MAX_PROCS)
        return false;
    const struct sim_proc_slot *s = &st->proc[srv];
    return atomic_load(&s->state) == SIM_SLOT_LIVE && atomic_load(&s->mps_role) == SIM_MPS_SERVER &&
           atomic_load(&s->generation) == atomic_load(&c->mps_server_gen);
}

static bool same_server(const struct sim_state *st, int a, int b)
{
    return atomic_load(&st->proc[a].mps_server) == atomic_load(&st->proc[b].mps_server) &&
           atomic_load(&st->proc[a].mps_server_gen) == atomic_load(&st->proc[b].mps_server_gen);
}

bool sim_excludes(const struct sim_state *st, int self, int i, int gpu)
{
    const struct sim_proc_slot *o = &st->proc[i];
    if (i == self || atomic_load(&o->state) != SIM_SLOT_LIVE || !((atomic_load(&o->gpu_mask) >> gpu) & 1u))
        return false;
    bool other_client = atomic_load(&o->mps_role) == SIM_MPS_CLIENT;
    if (other_client && !sim_mps_client_live(st, i))
        return false; /* its server is gone, and with it the context it used */
    if (other_client && atomic_load(&o->mps_server) == self &&
        atomic_load(&o->mps_server_gen) == atomic_load(&st->proc[self].generation))
        return false; /* our own client */
    if (sim_mps_client_live(st, self)) {
        const struct sim_proc_slot *me = &st->proc[self];
        if (i == atomic_load(&me->mps_server) && atomic_load(&o->generation) == atomic_load(&me->mps_server_gen))
            return false; /* our server */
        if (other_client && same_server(st, self, i))
            return false; /* a client of our server */
    }
    return true;
}

uint32_t sim_mps_share(const struct sim_state *st, int slot, int gpu, uint64_t now)
{
    const struct sim_proc_slot *me = &st->proc[slot];
    uint32_t mine = atomic_load(&me->mps_pct);
    mine = mine < 1 ? 1 : mine > 100 ? 100 : mine;
    uint64_t asked = mine;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        const struct sim_proc_slot *o = &st->proc[i];
        if (i == slot || atomic_load(&o->state) != SIM_SLOT_LIVE || atomic_load(&o->mps_role) != SIM_MPS_CLIENT ||
            atomic_load(&o->mps_lane[gpu]) <= now || !same_server(st, slot, i))
            continue;
        uint32_t p = atomic_load(&o->mps_pct);
        asked += p < 1 ? 1 : p > 100 ? 100 : p;
    }
    if (asked <= 100)
        return mine;
    uint64_t share = (uint64_t)mine * 100 / asked;
    return share ? (uint32_t)share : 1;
}

/* An MPS client's kernel runs on its own lane, beside the other clients'
 * (each client has its own queues on the GPU), on its part of the SMs: a
 * kernel that fills the GPU takes 100/p times as long at p percent. */
static uint64_t mps_exec_reserve(struct sim_handle *h, int gpu, uint64_t not_before, uint64_t dur_ns)
{
    struct sim_proc_slot *me = &h->st->proc[h->slot];
    uint64_t queue = h->st->config.queue_ns;
    uint64_t now = sim_now_ns();
    if (not_before > now + queue) {
        sim_sleep_until(not_before - queue);
        now = sim_now_ns();
    }
    /* Who else is busy is judged now, not at the kernel's start: a
     * saturating client keeps work queued past now, but at a start time
     * further ahead its queue may not reach yet, and both would then count
     * themselves alone (two at 100 % got 56 % each). */
    uint32_t pct = sim_mps_share(h->st, h->slot, gpu, now);
    uint64_t old = atomic_load(&me->mps_lane[gpu]), start, end;
    do {
        start = old > now ? old : now;
        if (not_before > start)
            start = not_before;
        end = start + dur_ns * 100 / pct;
    } while (!atomic_compare_exchange_weak(&me->mps_lane[gpu], &old, end));
    record_exec(h, gpu, start, end, pct);
    atomic_fetch_add(&me->busy_ns[gpu], dur_ns);
    atomic_fetch_add(&h->st->gpu[gpu].busy_total, dur_ns);
    return end;
}

uint64_t sim_exec_reserve(struct sim_handle *h, int gpu, uint64_t not_before, uint64_t dur_ns)
{
    if (atomic_load_explicit(&h->st->proc[h->slot].mps_role, memory_order_relaxed) == SIM_MPS_CLIENT)
        return mps_exec_reserve(h, gpu, not_before, dur_ns);
    struct sim_gpu_live *g = &h->st->gpu[gpu];
    uint64_t queue = h->st->config.queue_ns;
    uint64_t now = sim_now_ns();
    if (not_before > now + queue) {
        /* The launch queue is full: wait, as a real launch blocks when the
         * push buffer is. */
        sim_sleep_until(not_before - queue);
        now = sim_now_ns();
    }
    uint64_t old = atomic_load(&g->busy_until), start;
    do {
        start = old > now ? old : now;
        if (not_before > start)
            start = not_before;
    } while (!atomic_compare_exchange_weak(&g->busy_until, &old, start + dur_ns));
    record_exec(h, gpu, start, start + dur_ns, 100);
    atomic_fetch_add(&h->st->proc[h->slot].busy_ns[gpu], dur_ns);
    atomic_fetch_add(&g->busy_total, dur_ns);
    return start + dur_ns;
}

static void add_proc_busy(struct sim_pid_busy *per, int cap, int *n, const struct sim_pid_busy *r)
{
    for (int i = 0; i < *n; i++) {
        if (per[i].slot == r->slot && per[i].generation == r->generation) {
            per[i].ns += r->ns;
            return;
        }
    }
    if (*n < cap)
        per[(*n)++] = *r;
}

bool sim_busy_between(const struct sim_state *st, int gpu, uint64_t from, uint64_t to, uint64_t *total,
                      struct sim_pid_busy *per_pid, int cap, int *n_pids)
{
    const struct sim_gpu_live *g = &st->gpu[gpu];
    uint64_t head = atomic_load(&g->ring_head);
    uint64_t n = head < SIM_RING ? head : SIM_RING;
    uint64_t sum = 0, oldest = UINT64_MAX;
    int found = 0;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t idx = head - 1 - k;
        const struct sim_exec_record *r = &g->ring[idx % SIM_RING];
        if (atomic_load_explicit(&r->seq, memory_order_acquire) != idx + 1)
            continue;
        uint64_t s = atomic_load(&r->start_ns), e = atomic_load(&r->end_ns), pct = atomic_load(&r->pct);
        struct sim_pid_busy who = {.pid = atomic_load(&r->pid),
                                   .slot = atomic_load(&r->slot),
                                   .generation = atomic_load(&r->generation),
                                   .pidns = atomic_load(&r->pidns)};
        if (atomic_load(&r->seq) != idx + 1)
            continue; /* rewritten while we read it */
        if (s < oldest)
            oldest = s;
        uint64_t lo = s > from ? s : from, hi = e < to ? e : to;
        if (hi <= lo)
            continue;
        /* The GPU's work: an MPS stretch at p percent of the SMs is p
         * percent of the GPU for its length. */
        who.ns = (hi - lo) * (pct > 100 ? 100 : pct) / 100;
        sum += who.ns;
        if (per_pid)
            add_proc_busy(per_pid, cap, &found, &who);
    }
    *total = sum;
    if (n_pids)
        *n_pids = found;
    return head <= SIM_RING || oldest <= from;
}

/* ---- pids as each caller's namespace sees them ---------------------------- */

static uint64_t ns_inode(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

uint64_t sim_pidns_self(void)
{
    return ns_inode("/proc/self/ns/pid");
}

/* The last NSpid field of /proc/<pid>/status: the pid in its own namespace. */
static int32_t innermost_pid(long pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%ld/status", pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    int32_t nspid = 0;
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "NSpid:", 6) != 0)
            continue;
        char *tok = strrchr(line, '\t');
        nspid = tok ? (int32_t)strtol(tok + 1, NULL, 10) : 0;
        break;
    }
    fclose(f);
    return nspid;
}

/* The slow path: the process of namespace `ns` whose own pid is `nspid`,
 * among the processes /proc shows the caller. */
static int32_t pid_from_proc(uint64_t ns, int32_t nspid)
{
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    int32_t found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (pid <= 0 || *end != '\0' || pid > INT32_MAX)
            continue;
        char path[64];
        snprintf(path, sizeof(path), "/proc/%ld/ns/pid", pid);
        if (ns_inode(path) == ns && innermost_pid(pid) == nspid)
            found = (int32_t)pid;
    }
    closedir(d);
    return found;
}

int32_t sim_slot_pid(const struct sim_handle *h, int slot, uint64_t self_ns)
{
    const struct sim_proc_slot *s = &h->st->proc[slot];
    int32_t pid = atomic_load(&s->pid);
    uint64_t ns = atomic_load(&s->pidns);
    if (ns == 0 || ns == self_ns)
        return pid;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = SIM_SLOT_PID_OFFSET(slot), .l_len = 1};
    if (fcntl(h->fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK)
        return fl.l_pid > 0 ? (int32_t)fl.l_pid : 0;
    return pid_from_proc(ns, pid);
}

/* ---- faults ---------------------------------------------------------------- */

static void fault_changed(struct sim_state *st)
{
    atomic_fetch_add(&st->fault_epoch, 1);
    /* Every process maps the file: a shared (not private) futex wakes them
     * all. A poster killed before this line leaves waiters to their timeout. */
    syscall(SYS_futex, (uint32_t *)&st->fault_epoch, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void sim_fault_xid(struct sim_state *st, int gpu, uint64_t xid)
{
    struct sim_gpu_fault *f = &st->gpu[gpu].fault;
    uint64_t idx = atomic_fetch_add(&f->xid_head, 1);
    struct sim_xid_record *r = &f->xid[idx % SIM_XID_RING];
    atomic_store(&r->seq, 0);
    atomic_store(&r->xid, xid);
    atomic_store_explicit(&r->seq, idx + 1, memory_order_release);
    fault_changed(st);
}

void sim_fault_set_lost(struct sim_state *st, int gpu, bool lost)
{
    struct sim_gpu_fault *f = &st->gpu[gpu].fault;
    if (lost) {
        /* Lost before the XID is seen: whoever reacts to XID 79 finds the
         * GPU already off the bus, as on a real host. */
        if (atomic_exchange(&f->lost, 1) == 0)
            atomic_fetch_add(&f->lost_count, 1);
        sim_fault_xid(st, gpu, SIM_XID_GPU_LOST);
    } else {
        atomic_store(&f->lost, 0);
        fault_changed(st);
    }
}

bool sim_gpu_lost(const struct sim_state *st, int gpu)
{
    return atomic_load(&st->gpu[gpu].fault.lost) != 0;
}

uint64_t sim_gpu_lost_count(const struct sim_state *st, int gpu)
{
    return atomic_load(&st->gpu[gpu].fault.lost_count);
}

int sim_xid_read(const struct sim_state *st, int gpu, uint64_t seq, uint64_t *xid)
{
    const struct sim_xid_record *r = &st->gpu[gpu].fault.xid[seq % SIM_XID_RING];
    uint64_t got = atomic_load_explicit(&r->seq, memory_order_acquire);
    if (got > seq + 1)
        return -1;
    if (got != seq + 1)
        return 0;
    uint64_t v = atomic_load(&r->xid);
    if (atomic_load(&r->seq) != seq + 1)
        return -1; /* reused while we read it */
    *xid = v;
    return 1;
}

int sim_fault_wait(struct sim_state *st, uint32_t seen, uint64_t timeout_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(timeout_ns / 1000000000ULL), .tv_nsec = (long)(timeout_ns % 1000000000ULL)};
    /* FUTEX_WAIT returns at once if the epoch already moved (EAGAIN). */
    if (syscall(SYS_futex, (uint32_t *)&st->fault_epoch, FUTEX_WAIT, seen, &ts, NULL, 0) != 0 && errno == EINTR)
        return -1;
    return 0;
}
