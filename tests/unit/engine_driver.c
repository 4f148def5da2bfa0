/* The compute scheduler's engine (csrc/scheduler/engine.c) under ASan and
 * UBSan: tests/unit/test_compute_engine.py builds it with the engine, the
 * decision core and region.c, and runs it on an empty directory.
 *
 * One runner thread per GPU; one tenant thread per region playing libcgpu's
 * side of the grants protocol (cgpu/region.h), but the last one scribbles
 * random values over every field of its usage file the engine reads (a
 * hostile tenant); the main thread makes random
 * valid and invalid control calls for RUN_NS and checks each result against
 * what its own calls should have left in the engine (model[]). Then it stops
 * the engine, checks that every attached tenant's gate is ungated, detaches
 * everything and checks the gates are closed. Any failed check prints one
 * line and exits 1; success prints "ok". */
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
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cgpu/region.h"
#include "region_ops.h"
#include "scheduler.h"
#include "engine.h"

#define N 4          /* regions, one tenant thread each */
#define GPUS 2
#define KEYS 12      /* keys 0..KEYS-1; 0 is always refused */
#define RUN_NS 2000000000ll

/* dirs[N]: a missing one, [N+1]: files too short, [N+2]: wrong magic. */
static char dirs[N + 3][600];
static atomic_int tenants_stop;
static unsigned long long rng = 88172645463325252ull;
static unsigned long long next_rand(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

#define FAIL(...) do { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)

static void *map(const char *dir, const char *name, size_t size, int prot, int *fd_out)
{
    char path[700];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, (prot & PROT_WRITE ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) FAIL("open %s: %s", path, strerror(errno));
    void *p = mmap(NULL, size, prot, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) FAIL("mmap %s: %s", path, strerror(errno));
    if (fd_out) *fd_out = fd; else close(fd);
    return p;
}

static void write_file(const char *dir, const char *name, const void *data, size_t size)
{
    char path[700];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, data, size) != (ssize_t)size) FAIL("write %s: %s", path, strerror(errno));
    close(fd);
}

static void make_region(const char *dir, uint64_t grants_magic, size_t cut)
{
    if (mkdir(dir, 0755) != 0) FAIL("mkdir %s: %s", dir, strerror(errno));
    struct cgpu_grants *g = calloc(1, sizeof(*g));
    struct cgpu_usage *u = calloc(1, sizeof(*u));
    if (!g || !u) FAIL("out of memory");
    g->magic = grants_magic; g->version = CGPU_REGION_VERSION; g->size = sizeof(*g);
    u->magic = CGPU_USAGE_MAGIC; u->version = CGPU_REGION_VERSION; u->size = sizeof(*u);
    write_file(dir, CGPU_GRANTS_FILE, g, sizeof(*g) - cut);
    write_file(dir, CGPU_USAGE_FILE, u, sizeof(*u) - cut);
    free(g);
    free(u);
}

/* libcgpu.so's side of the protocol for device 0 of region i, without a GPU:
 * launch while open, count itself waiting and sleep on the gate while
 * closed, acknowledge every closing it sees. */
/* The hostile tenant: ledger count, states, watching bits, fence
 * acknowledgements, waiting counts and the bell, all random, all the time. */
static void scribble(struct cgpu_usage *u)
{
    unsigned long long x = 0x9E3779B97F4A7C15ull;
    while (!atomic_load(&tenants_stop)) {
        for (int k = 0; k < 64; k++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            uint32_t v = (uint32_t)(x >> 32);
            struct cgpu_proc_ledger *p = &u->proc[x % CGPU_MAX_PROCS];
            switch ((x >> 16) % 8) {
            case 0: atomic_store(&u->ledgers_used, v % 4 ? v % (CGPU_MAX_PROCS + 2) : v); break;
            case 1: atomic_store(&p->state, v % 4 ? CGPU_LEDGER_LIVE : v); break;
            case 2: atomic_store(&p->watching, v); break;
            case 3: atomic_store(&p->fence_ack[(x >> 8) % CGPU_MAX_DEVICES], v); break;
            case 4: atomic_store(&u->device[(x >> 8) % CGPU_MAX_DEVICES].waiting, v); break;
            case 5: atomic_store(&p->pid, (int32_t)v); break;
            default:
                atomic_store(&u->device[(x >> 8) % 2].bell, v);
                syscall(SYS_futex, (uint32_t *)&u->device[(x >> 8) % 2].bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
            }
        }
        usleep(200);
    }
}

static void *tenant(void *arg)
{
    int i = (int)(long)arg, fd;
    struct cgpu_usage *u = map(dirs[i], CGPU_USAGE_FILE, sizeof(*u), PROT_READ | PROT_WRITE, &fd);
    if (i == N - 1) {
        scribble(u);
        munmap(u, sizeof(*u));
        close(fd);
        return NULL;
    }
    const struct cgpu_grants *g = map(dirs[i], CGPU_GRANTS_FILE, sizeof(*g), PROT_READ, NULL);
    int ledger = cgpu_ledger_claim(u, fd, 1000 + i);
    if (ledger < 0) FAIL("tenant %d: no ledger", i);
    struct cgpu_proc_ledger *me = &u->proc[ledger];
    atomic_fetch_or(&me->watching, 1u);
    uint32_t acked = 0;
    int launched = 0;
    while (!atomic_load(&tenants_stop)) {
        uint32_t v = atomic_load(&g->device[0].gate);
        if (v & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED)) {
            usleep(100); /* a launch */
            launched = 1;
            continue;
        }
        if ((v & CGPU_GATE_SEQ_MASK) != acked) {
            acked = v & CGPU_GATE_SEQ_MASK;
            atomic_store_explicit(&me->fence_ack[0], acked | (launched ? CGPU_ACK_LAUNCHED : 0),
                                  memory_order_release);
            launched = 0;
            atomic_fetch_add(&u->device[0].bell, 1);
            syscall(SYS_futex, (uint32_t *)&u->device[0].bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        }
        atomic_fetch_add(&u->device[0].waiting, 1);
        struct timespec ts = {0, 5000000};
        syscall(SYS_futex, (uint32_t *)&g->device[0].gate, FUTEX_WAIT, v, &ts, NULL, 0);
        atomic_fetch_sub(&u->device[0].waiting, 1);
    }
    munmap((void *)g, sizeof(*g));
    munmap(u, sizeof(*u));
    close(fd);
    return NULL;
}

static uint32_t gate_now(int dir, unsigned slot)
{
    const struct cgpu_grants *g = map(dirs[dir], CGPU_GRANTS_FILE, sizeof(*g), PROT_READ, NULL);
    uint32_t gate = atomic_load(&g->device[slot].gate);
    munmap((void *)g, sizeof(*g));
    return gate;
}

/* The period of the window the tenant keeps to while cgpud is away, 0: none. */
static uint64_t alone_now(int dir, unsigned slot)
{
    const struct cgpu_grants *g = map(dirs[dir], CGPU_GRANTS_FILE, sizeof(*g), PROT_READ, NULL);
    uint64_t p = atomic_load(&g->device[slot].alone_period_ns);
    munmap((void *)g, sizeof(*g));
    return p;
}

struct runner { struct cgpu_engine *e; unsigned gpu; };
static void *run_gpu(void *arg)
{
    struct runner *r = arg;
    int rc = cgpu_engine_run(r->e, r->gpu);
    if (rc != 0) FAIL("run gpu %u: %d", r->gpu, rc);
    return NULL;
}

/* What the engine should hold, as this thread's calls told it. */
static struct { int on, dir; unsigned slot, share, weight; int high; } model[GPUS][KEYS];

static unsigned reserved(unsigned gpu, unsigned long long except)
{
    unsigned sum = 0;
    for (unsigned long long k = 0; k < KEYS; k++)
        if (model[gpu][k].on && k != except)
            sum += model[gpu][k].share;
    return sum;
}

static int expect_configure(unsigned gpu, int policy, uint64_t period, uint64_t slice, unsigned hp)
{
    if (gpu >= GPUS) return CGPU_SCHED_ENODEV;
    if (policy < CGPU_SCHED_FAIR || policy > CGPU_SCHED_NATIVE || period < CGPU_SCHED_MIN_PERIOD_NS ||
        period > CGPU_SCHED_MAX_PERIOD_NS || slice < CGPU_SCHED_MIN_SLICE_NS || slice > period ||
        (policy == CGPU_SCHED_SOFT && slice > CGPU_SCHED_SOFT_MAX_SLICE_NS) || hp > 100)
        return CGPU_SCHED_EINVAL;
    return 0;
}

static int attach(struct cgpu_engine *e, unsigned gpu, unsigned long long key, int dir, unsigned slot,
                  unsigned share, unsigned weight, int high)
{
    char err[160];
    int want, says = 0; /* says: a failure that must come with a message */
    if (gpu >= GPUS) want = CGPU_SCHED_ENODEV;
    else if (!key || slot >= CGPU_MAX_DEVICES) want = CGPU_SCHED_EINVAL;
    else if (model[gpu][key].on) /* a new share for a known tenant; the directory is not looked at */
        want = model[gpu][key].slot != slot ? CGPU_SCHED_EINVAL
             : share > 100 || weight < 1 || weight > 100 ? CGPU_SCHED_EINVAL
             : reserved(gpu, key) + share > 100 ? CGPU_SCHED_EDQUOT : 0;
    else if (dir >= N) want = dir == N ? -ENOENT : CGPU_SCHED_EINVAL, says = 1;
    else
        want = share > 100 || weight < 1 || weight > 100 ? CGPU_SCHED_EINVAL
             : reserved(gpu, 0) + share > 100 ? CGPU_SCHED_EDQUOT : 0;
    err[0] = '\0';
    int rc = cgpu_engine_attach(e, gpu, key, dirs[dir], slot, share, weight, high, err, sizeof(err));
    if (rc != want)
        FAIL("attach gpu %u key %llu dir %d slot %u share %u weight %u: %d, want %d (%s)", gpu, key, dir, slot,
             share, weight, rc, want, rc < 0 ? err : "");
    if (says && (!memchr(err, '\0', sizeof(err)) || !strstr(err, dirs[dir])))
        FAIL("attach of %s failed with %d and message \"%.160s\"", dirs[dir], rc, err);
    if (rc == 0 && !model[gpu][key].on)
        model[gpu][key].on = 1, model[gpu][key].dir = dir, model[gpu][key].slot = slot;
    if (rc == 0)
        model[gpu][key].share = share, model[gpu][key].weight = weight, model[gpu][key].high = high;
    return rc;
}

static void detach(struct cgpu_engine *e, unsigned gpu, unsigned long long key)
{
    int want = gpu >= GPUS ? CGPU_SCHED_ENODEV : model[gpu][key].on ? 0 : CGPU_SCHED_ENOENT;
    int rc = cgpu_engine_detach(e, gpu, key);
    if (rc != want) FAIL("detach gpu %u key %llu: %d, want %d", gpu, key, rc, want);
    if (rc == 0) model[gpu][key].on = 0;
}

static void tenant_get(struct cgpu_engine *e, unsigned gpu, unsigned long long key, int null_out)
{
    struct cgpu_sched_tenant_info info;
    int want = gpu >= GPUS ? CGPU_SCHED_ENODEV : !key ? CGPU_SCHED_EINVAL : !model[gpu][key].on ? CGPU_SCHED_ENOENT
             : null_out ? CGPU_SCHED_EINVAL : 0;
    int rc = cgpu_engine_tenant_get(e, gpu, key, null_out ? NULL : &info);
    if (rc != want) FAIL("tenant_get gpu %u key %llu: %d, want %d", gpu, key, rc, want);
    if (rc == 0 && (info.key != key || info.share_percent != model[gpu][key].share ||
                    info.weight != model[gpu][key].weight || info.high_priority != model[gpu][key].high))
        FAIL("tenant_get gpu %u key %llu: key %llu share %u weight %u high %d, want %u %u %d", gpu, key,
             (unsigned long long)info.key, info.share_percent, info.weight, info.high_priority,
             model[gpu][key].share, model[gpu][key].weight, model[gpu][key].high);
}

static long long elapsed_ns(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0->tv_sec) * 1000000000ll + (t.tv_nsec - t0->tv_nsec);
}

int main(int argc, char **argv)
{
    if (argc != 2) FAIL("usage: engine_driver DIR");
    for (int i = 0; i < N + 3; i++)
        snprintf(dirs[i], sizeof(dirs[i]), "%s/r%d", argv[1], i);
    for (int i = 0; i < N; i++)
        make_region(dirs[i], CGPU_GRANTS_MAGIC, 0);
    make_region(dirs[N + 1], CGPU_GRANTS_MAGIC, 8);
    make_region(dirs[N + 2], CGPU_USAGE_MAGIC, 0);

    if (cgpu_engine_create(0) || cgpu_engine_create(CGPU_SCHED_MAX_GPUS + 1)) FAIL("create accepted a bad count");
    struct cgpu_engine *e = cgpu_engine_create(GPUS);
    if (!e) FAIL("create failed");
    char err[160];
    struct cgpu_engine_stats st;
    struct cgpu_sched_tenant_info info;
    /* The NULL arguments the engine checks for. */
    if (cgpu_engine_configure(NULL, 0, CGPU_SCHED_FAIR, 100000000ull, 5000000ull, 0) != CGPU_SCHED_EINVAL ||
        cgpu_engine_attach(NULL, 0, 1, dirs[0], 0, 0, 1, 0, err, sizeof(err)) != CGPU_SCHED_EINVAL ||
        cgpu_engine_attach(e, 0, 1, NULL, 0, 0, 1, 0, err, sizeof(err)) != CGPU_SCHED_EINVAL ||
        cgpu_engine_attach(e, 0, 1, dirs[0], 0, 0, 1, 0, NULL, 16) != CGPU_SCHED_EINVAL ||
        cgpu_engine_attach(e, 0, 1, dirs[0], 0, 0, 1, 0, err, 0) != CGPU_SCHED_EINVAL ||
        cgpu_engine_detach(NULL, 0, 1) != CGPU_SCHED_EINVAL || cgpu_engine_run(NULL, 0) != CGPU_SCHED_EINVAL ||
        cgpu_engine_stats_get(NULL, 0, &st) != CGPU_SCHED_EINVAL ||
        cgpu_engine_stats_get(e, 0, NULL) != CGPU_SCHED_EINVAL ||
        cgpu_engine_stats_get(e, GPUS, NULL) != CGPU_SCHED_EINVAL ||
        cgpu_engine_tenant_get(NULL, 0, 1, &info) != CGPU_SCHED_EINVAL)
        FAIL("a NULL argument was not refused");
    cgpu_engine_stop(NULL);
    cgpu_engine_destroy(NULL);

    pthread_t run[GPUS], ten[N];
    struct runner rs[GPUS];
    for (unsigned i = 0; i < GPUS; i++) {
        rs[i] = (struct runner){e, i};
        if (pthread_create(&run[i], NULL, run_gpu, &rs[i]) != 0) FAIL("pthread_create");
    }
    if (cgpu_engine_run(e, GPUS) != CGPU_SCHED_ENODEV) FAIL("run accepted a bad GPU");
    for (long i = 0; i < N; i++)
        if (pthread_create(&ten[i], NULL, tenant, (void *)i) != 0) FAIL("pthread_create");
    /* A second runner for a GPU is refused once the first one runs. */
    for (int tries = 0; cgpu_engine_stats_get(e, 0, &st) == 0 && st.decisions == 0; tries++) {
        if (tries > 2000) FAIL("GPU 0 makes no decisions");
        usleep(1000);
    }
    if (cgpu_engine_run(e, 0) != CGPU_SCHED_EINVAL) FAIL("a second runner was accepted");

    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long calls = 0;
    do {
        unsigned long long r = next_rand();
        unsigned gpu = (unsigned)(r % 16 ? r % GPUS : GPUS + r % 3);
        unsigned long long key = (r >> 4) % KEYS;
        /* Mostly real regions; now and then a missing, short or foreign one. */
        int dir = (r >> 8) % 16 < 13 ? (int)((r >> 12) % N) : N + (int)((r >> 12) % 3);
        unsigned slot = (r >> 20) % 8 ? 0 : (r >> 23) % 8 ? 1 : CGPU_MAX_DEVICES + (unsigned)(r >> 26) % 3;
        unsigned share = (r >> 28) % 4 ? (unsigned)(r >> 30) % 40 : (unsigned)(r >> 30) % 130;
        unsigned weight = (r >> 38) % 8 ? 1 + (unsigned)(r >> 40) % 100 : (unsigned)(r >> 40) % 2 * 101;
        int high = (int)(r >> 48) % 2;
        calls++;
        switch ((r >> 50) % 12) {
        case 0: {
            int policy = (int)((r >> 20) % 8) - 1;
            uint64_t period = (r >> 53) % 4 ? 1000000ull + (r >> 24) % 300000000ull : (r >> 24) % 2000000000ull;
            uint64_t slice = (r >> 55) % 4 ? 10000ull + (r >> 32) % 20000000ull : (r >> 32) % 400000000ull;
            unsigned hp = (unsigned)(r >> 57) % 120;
            int want = expect_configure(gpu, policy, period, slice, hp);
            int rc = cgpu_engine_configure(e, gpu, policy, period, slice, hp);
            if (rc != want) FAIL("configure gpu %u policy %d: %d, want %d", gpu, policy, rc, want);
            break;
        }
        case 1: case 2: case 3:
            attach(e, gpu, key, dir, slot, share, weight, high);
            break;
        case 4:
            detach(e, gpu, key);
            break;
        case 5: case 6: {
            /* Whoever holds the GPU now goes, and comes straight back: the
             * engine may be awaiting its fence at that very moment. */
            unsigned g = gpu % GPUS;
            if (cgpu_engine_stats_get(e, g, &st) != 0) FAIL("stats_get gpu %u", g);
            if (st.holder >= KEYS) FAIL("gpu %u held by unknown key %llu", g, (unsigned long long)st.holder);
            if (!st.holder || !model[g][st.holder].on) break;
            unsigned s = model[g][st.holder].slot, sh = model[g][st.holder].share, w = model[g][st.holder].weight;
            detach(e, g, st.holder);
            if ((r >> 56) % 2)
                detach(e, g, st.holder);
            if ((r >> 57) % 4)
                attach(e, g, st.holder, (int)((r >> 12) % N), s, sh, w, high);
            break;
        }
        case 7: {
            int null_out = (r >> 20) % 4 == 0;
            int want = null_out ? CGPU_SCHED_EINVAL : gpu >= GPUS ? CGPU_SCHED_ENODEV : 0;
            int rc = cgpu_engine_stats_get(e, gpu, null_out ? NULL : &st);
            if (rc != want) FAIL("stats_get gpu %u%s: %d, want %d", gpu, null_out ? " NULL" : "", rc, want);
            if (rc == 0 && (st.policy < CGPU_SCHED_FAIR || st.policy > CGPU_SCHED_NATIVE || st.tenants < 0 ||
                            st.tenants > CGPU_SCHED_MAX_TENANTS || st.fences + st.fence_timeouts > st.grants ||
                            st.holder >= KEYS))
                FAIL("stats gpu %u: policy %d tenants %d holder %llu grants %llu fences %llu timeouts %llu", gpu,
                     st.policy, st.tenants, (unsigned long long)st.holder, (unsigned long long)st.grants,
                     (unsigned long long)st.fences, (unsigned long long)st.fence_timeouts);
            break;
        }
        case 8:
            tenant_get(e, gpu, key, (r >> 20) % 4 == 0);
            break;
        case 9: {
            /* Windows under fixed and the busy policies, on and off; other bits refused. */
            int which = (int)((r >> 20) % 8);
            int want = gpu >= GPUS ? CGPU_SCHED_ENODEV : which > 3 ? CGPU_SCHED_EINVAL : 0;
            int rc = cgpu_engine_set_windows(e, gpu, which);
            if (rc != want) FAIL("set_windows gpu %u %d: %d, want %d", gpu, which, rc, want);
            break;
        }
        default:
            usleep(200);
        }
    } while (elapsed_ns(&t0) < RUN_NS);

    cgpu_engine_stop(e);
    for (int i = 0; i < GPUS; i++) pthread_join(run[i], NULL);
    atomic_store(&tenants_stop, 1);
    for (int i = 0; i < N; i++) pthread_join(ten[i], NULL);

    /* Stopped: every gate of every tenant still attached is open for good,
     * but those with a window for cgpud's absence (fixed shares), which are
     * closed; and the engine holds exactly what the calls left. */
    int attached = 0;
    for (unsigned g = 0; g < GPUS; g++) {
        int n = 0;
        for (unsigned long long k = 1; k < KEYS; k++) {
            tenant_get(e, g, k, 0);
            n += model[g][k].on;
        }
        if (cgpu_engine_stats_get(e, g, &st) != 0 || st.tenants != n || st.holder != 0)
            FAIL("stopped gpu %u: %d tenants, holder %llu; want %d, none", g, st.tenants,
                 (unsigned long long)st.holder, n);
        attached += n;
    }
    int closed[N][2] = {{0}}; /* gates to be found closed after the detaches */
    for (unsigned g = 0; g < GPUS; g++)
        for (unsigned long long k = 1; k < KEYS; k++) {
            if (!model[g][k].on)
                continue;
            uint32_t gate = gate_now(model[g][k].dir, model[g][k].slot);
            int windowed = alone_now(model[g][k].dir, model[g][k].slot) != 0;
            if (windowed ? (gate & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED)) != 0 : !(gate & CGPU_GATE_UNGATED))
                FAIL("stopped gpu %u: gate of key %llu (%s device %u) is %#x, not %s", g, k,
                     dirs[model[g][k].dir], model[g][k].slot, gate, windowed ? "closed" : "ungated");
            closed[model[g][k].dir][model[g][k].slot] = 1;
        }
    for (unsigned g = 0; g < GPUS; g++) {
        if (cgpu_engine_stats_get(e, g, &st) != 0 || st.grants == 0 || st.fences == 0)
            FAIL("gpu %u: %llu grants, %llu fences: the tenants were never scheduled", g,
                 (unsigned long long)st.grants, (unsigned long long)st.fences);
        fprintf(stderr, "gpu %u: %llu decisions, %llu grants, %llu fences, %llu fence timeouts\n", g,
                (unsigned long long)st.decisions, (unsigned long long)st.grants, (unsigned long long)st.fences,
                (unsigned long long)st.fence_timeouts);
    }
    fprintf(stderr, "%ld calls, %d tenants attached at the end\n", calls, attached);
    /* Detached: gone, once, and its gate left closed. */
    for (unsigned g = 0; g < GPUS; g++) {
        for (unsigned long long k = 0; k < KEYS; k++) {
            detach(e, g, k);
            detach(e, g, k);
        }
        if (cgpu_engine_stats_get(e, g, &st) != 0 || st.tenants != 0) FAIL("gpu %u keeps %d tenants", g, st.tenants);
    }
    for (int i = 0; i < N; i++)
        for (unsigned slot = 0; slot < 2; slot++)
            if (closed[i][slot] && (gate_now(i, slot) & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED)))
                FAIL("%s device %u: gate %#x open after detach", dirs[i], slot, gate_now(i, slot));
    cgpu_engine_destroy(e);
    puts("ok");
    return 0;
}
