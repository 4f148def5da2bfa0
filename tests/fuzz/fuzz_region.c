/* libFuzzer target: the region checks (cgpu_limits_check, cgpu_usage_check,
 * cgpu_grants_check) over arbitrary bytes and sizes, and the process ledgers
 * (claim, reap, charge) on a usage region the tenant scribbles on between
 * calls. The file is a heap block of exactly its size, so AddressSanitizer
 * sees any read past it. Input layout: one byte picks the part, the rest is
 * read by fuzz_reader fields as commented below. */
#define _GNU_SOURCE
#include "region/region.c"

#include <sys/mman.h>

#include "fuzz_input.h"

enum { PART_LIMITS, PART_USAGE, PART_GRANTS, PART_LEDGERS, PART_COUNT };

static void fill_valid(uint8_t *buf, int part)
{
    if (part == PART_LIMITS) {
        struct cgpu_limits *l = (struct cgpu_limits *)buf;
        *l = (struct cgpu_limits){.magic = CGPU_LIMITS_MAGIC, .version = CGPU_REGION_VERSION,
                                  .size = sizeof(*l), .device_count = 1};
        strcpy(l->instance_id, "cgpu-0000aaaa");
        strcpy(l->device[0].uuid, "GPU-aaaa");
        l->device[0].mem_limit = 1ULL << 30;
    } else if (part == PART_USAGE) {
        struct cgpu_usage *u = (struct cgpu_usage *)buf;
        u->magic = CGPU_USAGE_MAGIC;
        u->version = CGPU_REGION_VERSION;
        u->size = sizeof(*u);
    } else {
        struct cgpu_grants *g = (struct cgpu_grants *)buf;
        g->magic = CGPU_GRANTS_MAGIC;
        g->version = CGPU_REGION_VERSION;
        g->size = sizeof(*g);
    }
}

static void check_limits_ok(const struct cgpu_limits *l, size_t size)
{
    CHECK(size >= sizeof(*l) && l->magic == CGPU_LIMITS_MAGIC && l->version == CGPU_REGION_VERSION);
    CHECK(l->device_count >= 1 && l->device_count <= CGPU_MAX_DEVICES && l->log_level <= CGPU_LOG_DEBUG);
    CHECK(memchr(l->instance_id, '\0', sizeof(l->instance_id)) != NULL);
    for (unsigned i = 0; i < l->device_count; i++) {
        CHECK(memchr(l->device[i].uuid, '\0', sizeof(l->device[i].uuid)) != NULL && l->device[i].uuid[0]);
        CHECK(l->device[i].core_percent <= 100);
    }
}

/* [mode][size delta: 2][errlen: 2][patches][checksum fix in mode]. */
static void fuzz_check(struct fuzz_reader *r, int part)
{
    static const size_t sizes[] = {sizeof(struct cgpu_limits), sizeof(struct cgpu_usage), sizeof(struct cgpu_grants)};
    unsigned mode = (unsigned)fuzz_uint(r, 1);
    size_t want = sizes[part];
    size_t size = want + (size_t)(int16_t)fuzz_uint(r, 2); /* wraps below zero on purpose, clamped next */
    if (mode & 4 || size > want + 4096)
        size = r->left; /* raw: the rest of the input is the whole file */
    size_t errlen = (size_t)fuzz_uint(r, 2) % 600;
    uint8_t *buf = calloc(1, size ? size : 1), *full = calloc(1, want);
    char *err = malloc(errlen ? errlen : 1);
    CHECK(buf && full && err);
    if (mode & 4) {
        const uint8_t *src;
        size_t got = fuzz_take(r, size, &src);
        memcpy(buf, src, got);
    } else {
        if (mode & 1)
            fill_valid(full, part);
        memcpy(buf, full, size < want ? size : want);
        fuzz_patch(r, buf, size, 2);
        if ((mode & 2) && part == PART_LIMITS && size >= want)
            ((struct cgpu_limits *)buf)->checksum =
                cgpu_region_checksum(buf, offsetof(struct cgpu_limits, checksum));
    }
    int rc = part == PART_LIMITS  ? cgpu_limits_check((const void *)buf, size, err, errlen)
             : part == PART_USAGE ? cgpu_usage_check((const void *)buf, size, err, errlen)
                                  : cgpu_grants_check((const void *)buf, size, err, errlen);
    CHECK(rc == 0 || rc == -1);
    if (rc == -1 && errlen)
        CHECK(memchr(err, '\0', errlen) != NULL && (errlen == 1 || err[0]));
    if (rc == 0) {
        CHECK(size >= want && memcmp(buf + 8, &(uint32_t){CGPU_REGION_VERSION}, 4) == 0);
        if (part == PART_LIMITS)
            check_limits_ok((const void *)buf, size);
    }
    free(buf);
    free(full);
    free(err);
}

static int lock_byte(int fd, int i, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = CGPU_LEDGER_LOCK_OFFSET(i), .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* A usage region with scribbles, then up to 64 operations. `other` is a
 * second open file description of the same file: the ledgers it locks
 * belong to live processes, which no reap may take. */
static void fuzz_ledgers(struct fuzz_reader *r)
{
    struct cgpu_usage *u = calloc(1, sizeof(*u));
    CHECK(u);
    fill_valid((uint8_t *)u, PART_USAGE);
    fuzz_patch(r, (uint8_t *)u, sizeof(*u), 3);
    int fd = memfd_create("cgpu-fuzz-usage", MFD_CLOEXEC);
    CHECK(fd >= 0);
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    int other = open(path, O_RDWR | O_CLOEXEC);
    CHECK(other >= 0);
    static uint8_t alive[CGPU_MAX_PROCS];
    memset(alive, 0, sizeof(alive));
    int mine = -1;
    const int32_t pid = (int32_t)getpid();
    for (int step = 0; step < 64 && r->left; step++) {
        unsigned op = (unsigned)fuzz_uint(r, 1) % 7, dev = (unsigned)fuzz_uint(r, 1) % (CGPU_MAX_DEVICES + 2);
        switch (op) {
        case 0: { /* a process of the instance starts */
            int i = cgpu_ledger_claim(u, fd, pid);
            CHECK(i >= -1 && i < CGPU_MAX_PROCS);
            if (i >= 0) {
                CHECK(!alive[i] && atomic_load(&u->proc[i].state) == CGPU_LEDGER_LIVE);
                CHECK(atomic_load(&u->proc[i].pid) == pid && cgpu_ledger_count(u) > i);
                for (unsigned d = 0; d < CGPU_MAX_DEVICES; d++)
                    CHECK(atomic_load(&u->proc[i].used[d]) == 0);
                mine = i;
            }
            break;
        }
        case 1: { /* the reaper runs: live processes keep their ledgers */
            static struct cgpu_proc_ledger before[CGPU_MAX_PROCS];
            memcpy(before, u->proc, sizeof(before));
            CHECK(cgpu_ledger_reap(u, fd, mine) >= 0);
            for (int i = 0; i < CGPU_MAX_PROCS; i++)
                if (alive[i] || i == mine)
                    CHECK(memcmp(&before[i], &u->proc[i], sizeof(before[i])) == 0);
            break;
        }
        case 2: { /* another process takes a ledger lock */
            int i = (int)(fuzz_uint(r, 2) % CGPU_MAX_PROCS);
            if (i != mine && lock_byte(other, i, F_WRLCK) == 0)
                alive[i] = 1;
            break;
        }
        case 3: { /* charge: one atomic step, never past the limit */
            uint64_t limit = fuzz_uint(r, 8), bytes = fuzz_uint(r, 8);
            int ledger = fuzz_uint(r, 1) & 1 ? mine : (int)(int16_t)fuzz_uint(r, 2);
            uint64_t was = dev < CGPU_MAX_DEVICES ? atomic_load(&u->device[dev].used) : 0;
            bool ok = cgpu_ledger_charge(u, ledger, dev, limit, bytes);
            if (ok)
                CHECK(dev < CGPU_MAX_DEVICES && atomic_load(&u->device[dev].used) == was + bytes &&
                      was + bytes <= limit && was + bytes >= was);
            else if (dev < CGPU_MAX_DEVICES)
                CHECK(atomic_load(&u->device[dev].used) == was);
            break;
        }
        case 4: { /* uncharge: counters floor at zero, never wrap */
            uint64_t bytes = fuzz_uint(r, 8);
            int ledger = fuzz_uint(r, 1) & 1 ? mine : (int)(int16_t)fuzz_uint(r, 2);
            uint64_t was = dev < CGPU_MAX_DEVICES ? atomic_load(&u->device[dev].used) : 0;
            cgpu_ledger_uncharge(u, ledger, dev, bytes);
            if (dev < CGPU_MAX_DEVICES)
                CHECK(atomic_load(&u->device[dev].used) == (was > bytes ? was - bytes : 0));
            break;
        }
        case 5: /* the tenant scribbles while processes run */
            fuzz_patch(r, (uint8_t *)u, sizeof(*u), 3);
            break;
        default:
            CHECK(cgpu_ledger_count(u) >= 0 && cgpu_ledger_count(u) <= CGPU_MAX_PROCS);
            break;
        }
    }
    close(other);
    close(fd);
    free(u);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_reader r = {data, size};
    int part = (int)(fuzz_uint(&r, 1) % PART_COUNT);
    if (part == PART_LEDGERS)
        fuzz_ledgers(&r);
    else
        fuzz_check(&r, part);
    return 0;
}
