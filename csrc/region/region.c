#define _GNU_SOURCE
#include "region_ops.h"
#include "region_charge.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

uint64_t cgpu_region_checksum(const void *data, size_t len)
{
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* Every region file starts with its magic, the layout version and its size;
 * nothing is read before the file is known to be big enough. */
static int check_header(const void *region, size_t file_size, uint64_t magic, size_t size, const char *what,
                        char *err, size_t errlen)
{
    struct {
        uint64_t magic;
        uint32_t version, size;
    } h;
    if (file_size >= size)
        memcpy(&h, region, sizeof(h));
    if (file_size < size || h.magic != magic) {
        snprintf(err, errlen, "not a cgpu %s region (bad size or magic)", what);
        return -1;
    }
    if (h.version != CGPU_REGION_VERSION || h.size != size) {
        snprintf(err, errlen, "%s region version %u (size %u); this library reads version %d (size %zu)", what,
                 h.version, h.size, CGPU_REGION_VERSION, size);
        return -1;
    }
    return 0;
}

int cgpu_limits_check(const struct cgpu_limits *l, size_t file_size, char *err, size_t errlen)
{
    if (check_header(l, file_size, CGPU_LIMITS_MAGIC, sizeof(*l), "limits", err, errlen) != 0)
        return -1;
    if (l->checksum != cgpu_region_checksum(l, offsetof(struct cgpu_limits, checksum))) {
        snprintf(err, errlen, "limits region checksum mismatch: the file is damaged");
        return -1;
    }
    if (l->device_count == 0 || l->device_count > CGPU_MAX_DEVICES) {
        snprintf(err, errlen, "limits region names %u devices (1-%d allowed)", l->device_count, CGPU_MAX_DEVICES);
        return -1;
    }
    if (memchr(l->instance_id, '\0', sizeof(l->instance_id)) == NULL) {
        snprintf(err, errlen, "limits region instance id is not terminated");
        return -1;
    }
    if (l->log_level > CGPU_LOG_DEBUG) {
        snprintf(err, errlen, "limits region log level %u is not 0-3", l->log_level);
        return -1;
    }
    for (unsigned i = 0; i < l->device_count; i++) {
        if (memchr(l->device[i].uuid, '\0', sizeof(l->device[i].uuid)) == NULL || l->device[i].uuid[0] == '\0') {
            snprintf(err, errlen, "limits region device %u has no UUID", i);
            return -1;
        }
        if (l->device[i].core_percent > 100) {
            snprintf(err, errlen, "limits region device %u has a compute share over 100%%", i);
            return -1;
        }
    }
    return 0;
}

/* Ledgers worth looking at: claims fill from the front, so scans stop at the
 * first never-claimed one instead of walking all of them. */
static int ledgers_in_use(const struct cgpu_usage *u)
{
    uint32_t n = atomic_load_explicit(&u->ledgers_used, memory_order_acquire);
    return n < CGPU_MAX_PROCS ? (int)n : CGPU_MAX_PROCS;
}

int cgpu_ledger_count(const struct cgpu_usage *u)
{
    return ledgers_in_use(u);
}

int cgpu_usage_check(const struct cgpu_usage *u, size_t file_size, char *err, size_t errlen)
{
    return check_header(u, file_size, CGPU_USAGE_MAGIC, sizeof(*u), "usage", err, errlen);
}

int cgpu_grants_check(const struct cgpu_grants *g, size_t file_size, char *err, size_t errlen)
{
    return check_header(g, file_size, CGPU_GRANTS_MAGIC, sizeof(*g), "grants", err, errlen);
}

/* Claims of one instance take turns on this byte (an OFD write lock held
 * for the claim only), so the claimer that finds no ledger lock held can
 * recount the device counters while no other claim starts. */
#define CLAIM_LOCK_OFFSET CGPU_LEDGER_LOCK_OFFSET(CGPU_MAX_PROCS)
#define CLAIM_WAIT_MAX_NS 2000000000L

static int lock_bytes(int fd, int cmd, short type, long start, long len)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = start, .l_len = len};
    return fcntl(fd, cmd, &fl);
}

static int ledger_lock(int fd, int i, short type)
{
    return lock_bytes(fd, F_OFD_SETLK, type, CGPU_LEDGER_LOCK_OFFSET(i), 1);
}

static void sub_floor(_Atomic uint64_t *v, uint64_t n)
{
    cgpu_sub_floor(v, n);
}

/* Gives a dead process's usage back to the instance. */
static void release_ledger(struct cgpu_usage *u, int i)
{
    struct cgpu_proc_ledger *p = &u->proc[i];
    for (unsigned d = 0; d < CGPU_MAX_DEVICES; d++) {
        uint64_t held = atomic_exchange(&p->used[d], 0);
        if (held)
            sub_floor(&u->device[d].used, held);
    }
}

/* Hands a ledger back once its usage is gone from it. */
static void mark_free(struct cgpu_proc_ledger *p)
{
    atomic_store(&p->watching, 0);
    atomic_store(&p->pid, 0);
    atomic_store(&p->state, CGPU_LEDGER_FREE);
}

static void note_claimed(struct cgpu_usage *u, int i)
{
    uint32_t cur = atomic_load(&u->ledgers_used);
    while (cur < (uint32_t)i + 1 && !atomic_compare_exchange_weak(&u->ledgers_used, &cur, (uint32_t)i + 1)) {
    }
}

static int claim_free(struct cgpu_usage *u, int fd, int32_t pid)
{
    for (int i = 0; i < CGPU_MAX_PROCS; i++) {
        struct cgpu_proc_ledger *p = &u->proc[i];
        /* Only free ledgers: a live one whose lock we get may be held by
         * this very file description, not by a dead process. */
        if (atomic_load(&p->state) != CGPU_LEDGER_FREE || ledger_lock(fd, i, F_WRLCK) != 0)
            continue;
        uint32_t expect = CGPU_LEDGER_FREE;
        if (!atomic_compare_exchange_strong(&p->state, &expect, CGPU_LEDGER_CLAIMING)) {
            ledger_lock(fd, i, F_UNLCK);
            continue;
        }
        for (unsigned d = 0; d < CGPU_MAX_DEVICES; d++) {
            atomic_store(&p->used[d], 0);
            atomic_store(&p->fence_ack[d], 0);
        }
        atomic_store(&p->watching, 0); /* cgpud waits for no fence from a fresh process */
        atomic_store(&p->pid, pid);
        note_claimed(u, i);
        atomic_store(&p->state, CGPU_LEDGER_LIVE);
        return i;
    }
    return -1;
}

/* A charge reserves on the device before it records in the ledger, and a
 * return takes from the ledger before the device: a process killed between
 * the two leaves bytes counted that no ledger holds (the safe side), which
 * reaping cannot tell from a live process's charge in flight. With every
 * ledger lock free no process can be charging, so the counters are recounted
 * from nothing. The caller holds the claim lock: no claim starts meanwhile. */
static void recount_if_nobody_lives(struct cgpu_usage *u, int fd)
{
    if (lock_bytes(fd, F_OFD_SETLK, F_WRLCK, CGPU_LEDGER_LOCK_OFFSET(0), CGPU_MAX_PROCS) != 0)
        return; /* a process holds its ledger, or a reaper is at one */
    int n = ledgers_in_use(u);
    for (int i = 0; i < n; i++) {
        struct cgpu_proc_ledger *p = &u->proc[i];
        if (atomic_load(&p->state) == CGPU_LEDGER_FREE)
            continue;
        for (unsigned d = 0; d < CGPU_MAX_DEVICES; d++)
            atomic_store(&p->used[d], 0);
        mark_free(p);
    }
    for (unsigned d = 0; d < CGPU_MAX_DEVICES; d++)
        atomic_store(&u->device[d].used, 0);
    atomic_store(&u->ledgers_used, 0);
    lock_bytes(fd, F_OFD_SETLK, F_UNLCK, CGPU_LEDGER_LOCK_OFFSET(0), CGPU_MAX_PROCS);
}

/* A claim holds the turn for microseconds, but a stopped process (a
 * debugger, SIGSTOP) can hold it for good: the wait is bounded, and a claim
 * that gave up goes on without its turn and without recounting. */
static int take_claim_turn(int fd)
{
    long pause_ns = 20000, waited_ns = 0;
    for (;;) {
        if (lock_bytes(fd, F_OFD_SETLK, F_WRLCK, CLAIM_LOCK_OFFSET, 1) == 0)
            return 0;
        if ((errno != EAGAIN && errno != EACCES && errno != EINTR) || waited_ns >= CLAIM_WAIT_MAX_NS)
            return -1;
        struct timespec ts = {0, pause_ns};
        nanosleep(&ts, NULL);
        waited_ns += pause_ns;
        pause_ns = pause_ns < 1000000 ? pause_ns * 2 : 1000000;
    }
}

int cgpu_ledger_claim(struct cgpu_usage *u, int fd, int32_t pid)
{
    int serial = take_claim_turn(fd);
    if (serial == 0)
        recount_if_nobody_lives(u, fd);
    int i = claim_free(u, fd, pid);
    if (i < 0 && cgpu_ledger_reap(u, fd, -1) > 0)
        i = claim_free(u, fd, pid);
    if (serial == 0)
        lock_bytes(fd, F_OFD_SETLK, F_UNLCK, CLAIM_LOCK_OFFSET, 1);
    return i;
}

int cgpu_ledger_reap(struct cgpu_usage *u, int fd, int self)
{
    int reaped = 0, n = ledgers_in_use(u);
    for (int i = 0; i < n; i++) {
        struct cgpu_proc_ledger *p = &u->proc[i];
        if (i == self || atomic_load(&p->state) != CGPU_LEDGER_LIVE)
            continue;
        if (ledger_lock(fd, i, F_WRLCK) != 0)
            continue; /* owner alive */
        uint32_t live = CGPU_LEDGER_LIVE;
        if (atomic_compare_exchange_strong(&p->state, &live, CGPU_LEDGER_CLAIMING)) {
            release_ledger(u, i);
            mark_free(p);
            reaped++;
        }
        ledger_lock(fd, i, F_UNLCK);
    }
    return reaped;
}

bool cgpu_usage_reserve(struct cgpu_usage *u, unsigned dev, uint64_t limit, uint64_t bytes)
{
    return cgpu_usage_reserve_inline(u, dev, limit, bytes);
}

void cgpu_usage_unreserve(struct cgpu_usage *u, unsigned dev, uint64_t bytes)
{
    if (dev < CGPU_MAX_DEVICES)
        sub_floor(&u->device[dev].used, bytes);
}

uint64_t cgpu_grants_store_mem_limit(struct cgpu_grants *g, const struct cgpu_usage *u, unsigned dev, uint64_t limit)
{
    if (dev >= CGPU_MAX_DEVICES)
        return 0;
    atomic_store_explicit(&g->device[dev].mem_limit, limit, memory_order_seq_cst);
    return u ? atomic_load_explicit(&u->device[dev].used, memory_order_seq_cst) : 0;
}

bool cgpu_usage_over_live(const struct cgpu_usage *u, unsigned dev, const CGPU_ATOMIC uint64_t *live, uint64_t limit)
{
    uint64_t now = atomic_load_explicit(live, memory_order_seq_cst);
    return now < limit && atomic_load_explicit(&u->device[dev].used, memory_order_relaxed) > now;
}

bool cgpu_ledger_charge(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t limit, uint64_t bytes)
{
    return cgpu_ledger_charge_inline(u, ledger, dev, limit, bytes);
}

void cgpu_ledger_uncharge(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t bytes)
{
    cgpu_ledger_uncharge_inline(u, ledger, dev, bytes);
}
