/* libcgpu.so: finding the instance region, the process ledger, logging. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../region/path.h"
#include "../region/region_file.h"
#include "../region/region_ops.h"
#include "libcgpu.h"

/* What a gate reads without a grants file, and when launches are refused. */
static const _Atomic uint32_t ungated_word = CGPU_GATE_UNGATED;
static const _Atomic uint32_t refused_word = 0;
/* launch_gate before init and with several devices: never ungated nor open. */
static const _Atomic uint32_t full_path_word = 0;

struct cgpu_process g_cgpu = {.usage_fd = -1,
                              .ledger = -1,
                              .grants_fd = -1,
                              .ledger_lock = PTHREAD_MUTEX_INITIALIZER,
                              .launch_gate = &full_path_word};

void cgpu_log(int level, const char *fmt, ...)
{
    if (level > g_cgpu.log_level)
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "cgpu[%d]: %s\n", (int)getpid(), line);
}

/* The environment may only make the library louder, never quieter. */
static int env_log_level(void)
{
    const char *v = getenv(CGPU_LOG_ENV);
    if (!v || v[0] < '0' || v[0] > '3' || v[1] != '\0')
        return CGPU_LOG_QUIET;
    return v[0] - '0';
}

/* Maps dir/name whole; the hint names what the user can change. */
static int map_file(const char *dir, const char *name, int flags, struct cgpu_region_file *f, char *err,
                    size_t errlen)
{
    int rc = cgpu_region_file_map(dir, name, flags, 0, f, err, errlen);
    if (rc == -ENAMETOOLONG) {
        size_t n = strlen(err);
        snprintf(err + n, errlen - n, "; use a shorter %s", CGPU_REGION_ENV);
    }
    return rc;
}

/* Copies what the hot paths need out of the limits file, which then goes. */
static int load_limits(const char *dir, char *err, size_t errlen)
{
    struct cgpu_region_file f;
    if (map_file(dir, CGPU_LIMITS_FILE, O_RDONLY, &f, err, errlen) != 0)
        return -1;
    close(f.fd);
    const struct cgpu_limits *l = f.addr;
    int rc = cgpu_limits_check(l, f.size, err, errlen);
    if (rc == 0) {
        g_cgpu.device_count = l->device_count;
        for (unsigned i = 0; i < l->device_count; i++) {
            memcpy(g_cgpu.device[i].uuid, l->device[i].uuid, CGPU_UUID_LEN);
            atomic_store_explicit(&g_cgpu.device[i].file_limit, l->device[i].mem_limit, memory_order_relaxed);
            g_cgpu.device[i].mem_limit = &g_cgpu.device[i].file_limit;
        }
        if ((int)l->log_level > g_cgpu.log_level)
            g_cgpu.log_level = (int)l->log_level;
    }
    munmap(f.addr, f.size);
    return rc;
}

static int load_usage(const char *dir, char *err, size_t errlen)
{
    struct cgpu_region_file f;
    if (map_file(dir, CGPU_USAGE_FILE, O_RDWR, &f, err, errlen) != 0)
        return -1;
    if (cgpu_usage_check(f.addr, f.size, err, errlen) != 0) {
        munmap(f.addr, f.size);
        close(f.fd);
        return -1;
    }
    g_cgpu.usage = f.addr;
    g_cgpu.usage_fd = f.fd;
    /* map_file joined the same path into a buffer of the same size */
    _Static_assert(sizeof(g_cgpu.usage_path) == CGPU_REGION_PATH_MAX, "usage_path holds what map_file opened");
    (void)cgpu_join_path(g_cgpu.usage_path, sizeof(g_cgpu.usage_path), dir, CGPU_USAGE_FILE);
    return 0;
}

static void gates_point_at(const _Atomic uint32_t *word)
{
    for (unsigned i = 0; i < CGPU_MAX_DEVICES; i++)
        g_cgpu.gate[i] = word;
}

static void refuse_launches(const char *why)
{
    gates_point_at(&refused_word);
    snprintf(g_cgpu.refused_why, sizeof(g_cgpu.refused_why), "%.500s", why);
    g_cgpu.launches_refused = true;
}

/* The scheduler's gates, read-only. No file: no compute control. A file we
 * cannot trust: no launches, rather than launches nobody schedules. */
static void load_grants(const char *dir)
{
    char path[4096], err[512];
    if (!cgpu_join_path(path, sizeof(path), dir, CGPU_GRANTS_FILE)) {
        refuse_launches("region path too long"); /* cannot tell: fail closed */
        cgpu_log(CGPU_LOG_ERROR, "region path %.200s.../%s too long: kernel launches fail", dir, CGPU_GRANTS_FILE);
        return;
    }
    if (access(path, F_OK) != 0 && errno == ENOENT) {
        cgpu_log(CGPU_LOG_INFO, "no %s: kernel launches are not gated", path);
        return;
    }
    struct cgpu_region_file f;
    int rc = map_file(dir, CGPU_GRANTS_FILE, O_RDONLY, &f, err, sizeof(err));
    if (rc == 0 && (rc = cgpu_grants_check(f.addr, f.size, err, sizeof(err))) != 0) {
        munmap(f.addr, f.size);
        close(f.fd);
    }
    if (rc != 0) {
        refuse_launches(err);
        return;
    }
    const struct cgpu_grants *g = f.addr;
    /* Mapped for the life of the process: the hot path holds pointers into
     * it. The descriptor stays too, and a forked child shares it: a closed
     * gate's wait probes cgpud's lock through it. */
    g_cgpu.grants_fd = f.fd;
    for (unsigned i = 0; i < CGPU_MAX_DEVICES; i++)
        g_cgpu.gate[i] = &g->device[i].gate;
    /* A cgpud that resizes keeps the live limit here; an older one left 0. */
    for (unsigned i = 0; i < g_cgpu.device_count; i++)
        if (atomic_load_explicit(&g->device[i].mem_limit, memory_order_relaxed) != 0)
            g_cgpu.device[i].mem_limit = &g->device[i].mem_limit;
}

/* A forked child must not share its parent's ledger (or its lock): it gets
 * its own when it first allocates or launches. Only async-signal-safe calls
 * here. */
static void after_fork_child(void)
{
    pthread_mutex_init(&g_cgpu.ledger_lock, NULL);
    if (g_cgpu.usage_fd >= 0)
        close(g_cgpu.usage_fd);
    g_cgpu.usage_fd = -1;
    g_cgpu.ledger = -1;
    cgpu_gate_after_fork();
    cgpu_memory_after_fork();
}

/* Caller holds ledger_lock. */
int cgpu_claim_ledger_locked(void)
{
    if (g_cgpu.ledger >= 0)
        return 0;
    if (g_cgpu.usage_fd < 0) {
        g_cgpu.usage_fd = open(g_cgpu.usage_path, O_RDWR | O_CLOEXEC);
        if (g_cgpu.usage_fd < 0)
            return -1;
    }
    g_cgpu.ledger = cgpu_ledger_claim(g_cgpu.usage, g_cgpu.usage_fd, (int32_t)getpid());
    return g_cgpu.ledger >= 0 ? 0 : -1;
}

const char *cgpu_region_dir(void)
{
    /* Inside a container the mounted region is authoritative: the
     * environment cannot point the library anywhere else. */
    if (access(CGPU_REGION_FIXED_DIR "/" CGPU_LIMITS_FILE, F_OK) == 0)
        return CGPU_REGION_FIXED_DIR;
    const char *env = getenv(CGPU_REGION_ENV);
    return env && env[0] ? env : NULL;
}

static void init_locked(void)
{
    g_cgpu.log_level = env_log_level();
    gates_point_at(&ungated_word);
    const char *dir = cgpu_region_dir();
    if (!dir) {
        atomic_store(&g_cgpu.state, CGPU_PASSTHROUGH);
        return;
    }
    char err[512] = "";
    if (load_limits(dir, err, sizeof(err)) != 0 || load_usage(dir, err, sizeof(err)) != 0 ||
        cgpu_claim_ledger_locked() != 0) {
        if (!err[0])
            snprintf(err, sizeof(err), "all %d process ledgers of %s are taken", CGPU_MAX_PROCS, dir);
        /* Fail closed, loudly: a broken region must not mean "unlimited".
         * With a grants file the instance is compute-scheduled, and without
         * the region no launch could take part in it. */
        char grants[4096];
        /* a path too long to check may name a grants file: fail closed */
        bool gated = !cgpu_join_path(grants, sizeof(grants), dir, CGPU_GRANTS_FILE) || access(grants, F_OK) == 0;
        if (gated)
            refuse_launches(""); /* said here */
        fprintf(stderr, "cgpu[%d]: GPU memory limits unavailable (%s); device allocations%s will fail\n",
                (int)getpid(), err, gated ? " and kernel launches" : "");
        atomic_store(&g_cgpu.state, CGPU_BROKEN);
        return;
    }
    load_grants(dir);
    /* Usage left by processes that died since the last one looked. */
    cgpu_ledger_reap(g_cgpu.usage, g_cgpu.usage_fd, g_cgpu.ledger);
    /* Without the handler a forked child would share its parent's ledger:
     * refuse to enforce rather than enforce wrongly. */
    int rc = pthread_atfork(NULL, NULL, after_fork_child);
    if (rc != 0) {
        fprintf(stderr, "cgpu[%d]: GPU memory limits unavailable (cannot register a fork handler: %s);"
                        " device allocations will fail\n", (int)getpid(), strerror(rc));
        atomic_store(&g_cgpu.state, CGPU_BROKEN);
        return;
    }
    cgpu_log(CGPU_LOG_INFO, "instance region %s: %u device(s)", dir, g_cgpu.device_count);
    atomic_store(&g_cgpu.state, CGPU_ACTIVE);
}

void cgpu_init_slow(void)
{
    static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&init_lock);
    if (atomic_load(&g_cgpu.state) == CGPU_UNINIT) {
        pthread_mutex_lock(&g_cgpu.ledger_lock);
        init_locked();
        /* gate[] is final: launches that read this pointer skip `state`;
         * until it is stored they take the full path, which reads `state`. */
        atomic_store_explicit(&g_cgpu.launch_gate, g_cgpu.device_count <= 1 ? g_cgpu.gate[0] : &full_path_word,
                              memory_order_release);
        pthread_mutex_unlock(&g_cgpu.ledger_lock);
    }
    pthread_mutex_unlock(&init_lock);
}
