/* libFuzzer target: how libcgpu.so loads its instance region
 * (csrc/intercept/init.c): limits, usage and grants files with arbitrary
 * sizes and contents, the ledger claim and the first reap, exactly the
 * sequence init_locked() runs after region_dir() has picked a directory.
 * Input: per file [mode][size delta: 2][patches]; mode 0 = no file,
 * bit 1 = start from a valid region, bit 2 = fix the limits checksum. */
#define _GNU_SOURCE
#include <pthread.h>

/* Each input would register another fork handler; the harness never forks. */
#define pthread_atfork(prepare, parent, child) ((void)(child), 0)
#include "intercept/init.c"
#include "region/region.c"
#include "region/region_file.c"

#include "fuzz_input.h"
#include "fuzz_scratch.h"

/* Launch gating lives in launch.c, which needs the driver; only its fork
 * hook is referenced here, and the harness never forks. */
void cgpu_gate_after_fork(void)
{
}

static const char *g_dir;

static const char *const NAMES[] = {CGPU_LIMITS_FILE, CGPU_USAGE_FILE, CGPU_GRANTS_FILE, NULL};

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    g_dir = fuzz_scratch_make("load", NAMES);
    return 0;
}

static const size_t SIZES[] = {sizeof(struct cgpu_limits), sizeof(struct cgpu_usage), sizeof(struct cgpu_grants)};
static const uint64_t MAGICS[] = {CGPU_LIMITS_MAGIC, CGPU_USAGE_MAGIC, CGPU_GRANTS_MAGIC};

/* Writes one region file; returns its size, or -1 if there is none. */
static long write_region(struct fuzz_reader *r, int which)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", g_dir, NAMES[which]);
    unlink(path);
    unsigned mode = (unsigned)fuzz_uint(r, 1);
    long size = (long)SIZES[which] + (int16_t)fuzz_uint(r, 2);
    if (mode % 8 == 0 || size < 0)
        return -1;
    uint8_t *buf = calloc(1, (size_t)size + 1);
    CHECK(buf);
    if (mode & 2 && (size_t)size >= 16) {
        struct {
            uint64_t magic;
            uint32_t version, size;
        } h = {MAGICS[which], CGPU_REGION_VERSION, (uint32_t)SIZES[which]};
        memcpy(buf, &h, sizeof(h));
        if (which == 0 && (size_t)size >= SIZES[0]) {
            struct cgpu_limits *l = (void *)buf;
            l->device_count = 1;
            strcpy(l->instance_id, "cgpu-0000aaaa");
            strcpy(l->device[0].uuid, "GPU-aaaa");
            l->device[0].mem_limit = 1ULL << 30;
        }
    }
    fuzz_patch(r, buf, (size_t)size, 2);
    if (which == 0 && mode & 4 && (size_t)size >= SIZES[0])
        ((struct cgpu_limits *)buf)->checksum = cgpu_region_checksum(buf, offsetof(struct cgpu_limits, checksum));
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, buf, (size_t)size) == size);
    close(fd);
    free(buf);
    return size;
}

static void reset_process(void)
{
    atomic_store(&g_cgpu.state, CGPU_UNINIT);
    g_cgpu.log_level = CGPU_LOG_QUIET;
    g_cgpu.device_count = 0;
    g_cgpu.usage = NULL;
    g_cgpu.usage_fd = -1;
    g_cgpu.ledger = -1;
    g_cgpu.usage_path[0] = '\0';
    g_cgpu.launches_refused = false;
    g_cgpu.refused_why[0] = '\0';
    gates_point_at(&ungated_word);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_reader r = {data, size};
    long sizes[3];
    for (int i = 0; i < 3; i++)
        sizes[i] = write_region(&r, i);
    reset_process();
    char err[512] = "";
    int rc = load_limits(g_dir, err, sizeof(err));
    g_cgpu.log_level = CGPU_LOG_QUIET; /* a valid region may ask for debug logs: keep the run quiet */
    if (rc == 0) {
        CHECK(sizes[0] >= (long)SIZES[0]);
        CHECK(g_cgpu.device_count >= 1 && g_cgpu.device_count <= CGPU_MAX_DEVICES);
        for (unsigned i = 0; i < g_cgpu.device_count; i++)
            CHECK(memchr(g_cgpu.device[i].uuid, '\0', CGPU_UUID_LEN) != NULL);
        rc = load_usage(g_dir, err, sizeof(err));
    }
    if (rc == 0) {
        CHECK(sizes[1] >= (long)SIZES[1] && g_cgpu.usage && g_cgpu.usage_fd >= 0);
        rc = cgpu_claim_ledger_locked();
        CHECK(rc == -1 || (g_cgpu.ledger >= 0 && g_cgpu.ledger < CGPU_MAX_PROCS));
    }
    if (rc == 0) {
        load_grants(g_dir);
        if (sizes[2] < 0)
            CHECK(!g_cgpu.launches_refused && g_cgpu.gate[0] == &ungated_word);
        else if (sizes[2] < (long)SIZES[2])
            CHECK(g_cgpu.launches_refused && g_cgpu.gate[CGPU_MAX_DEVICES - 1] == &refused_word);
        CHECK(cgpu_ledger_reap(g_cgpu.usage, g_cgpu.usage_fd, g_cgpu.ledger) >= 0);
        CHECK(atomic_load(&g_cgpu.usage->proc[g_cgpu.ledger].state) == CGPU_LEDGER_LIVE);
    } else {
        CHECK(memchr(err, '\0', sizeof(err)) != NULL);
    }
    /* What the process would keep mapped for its life goes with the input. */
    const _Atomic uint32_t *gate = g_cgpu.gate[0];
    if (gate != &ungated_word && gate != &refused_word)
        munmap((char *)gate - offsetof(struct cgpu_grants, device), (size_t)sizes[2]);
    if (g_cgpu.usage)
        munmap(g_cgpu.usage, (size_t)sizes[1]);
    if (g_cgpu.usage_fd >= 0)
        close(g_cgpu.usage_fd);
    return 0;
}
