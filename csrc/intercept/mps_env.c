/* MPS clients' limits from the instance, not from the tenant. On an MPS
 * GPU the driver reads CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and
 * CUDA_MPS_PINNED_DEVICE_MEM_LIMIT from the process's environment at
 * cuInit, and they can only lower what the MPS server allows (100 % and no
 * limit, as cgpud starts it). The environment is the tenant's to change,
 * so before the program runs libcgpu lowers them to the instance's core
 * share and memory limit read from its region: a raise the tenant wrote is
 * undone, a lower value is kept. Only where the driver will be an MPS
 * client, i.e. a control socket is where it looks (CUDA_MPS_PIPE_DIRECTORY,
 * else /tmp/nvidia-mps), and only for a one-GPU instance (mps nodes give
 * one GPU per container): one access() per process start elsewhere.
 * Memory stays enforced by libcgpu's own accounting either way; a process
 * that does not load libcgpu is not helped here (docs/modes.md). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../region/path.h"
#include "../region/region_file.h"
#include "../region/region_ops.h"
#include "libcgpu.h"

#define MPS_PIPE_ENV "CUDA_MPS_PIPE_DIRECTORY"
#define MPS_DEFAULT_PIPE "/tmp/nvidia-mps"
#define MPS_PERCENT_ENV "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
#define MPS_MEM_LIMIT_ENV "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

static bool will_be_mps_client(void)
{
    const char *pipe = getenv(MPS_PIPE_ENV);
    char sock[CGPU_REGION_PATH_MAX];
    if (!pipe || !*pipe)
        pipe = MPS_DEFAULT_PIPE;
    return cgpu_join_path(sock, sizeof(sock), pipe, "control") && access(sock, F_OK) == 0;
}

/* "<digits>[K|M|G|T][B]" in bytes; false if malformed or too large. */
static bool parse_size(const char *s, const char *end, unsigned long long *out)
{
    unsigned long long v = 0;
    const char *p = s;
    for (; p < end && *p >= '0' && *p <= '9'; p++) {
        if (v > (~0ULL - 9) / 10)
            return false;
        v = v * 10 + (unsigned long long)(*p - '0');
    }
    if (p == s)
        return false;
    unsigned shift = 0;
    if (p < end && strchr("KkMmGgTt", *p)) {
        shift = *p == 'K' || *p == 'k' ? 10 : *p == 'M' || *p == 'm' ? 20 : *p == 'G' || *p == 'g' ? 30 : 40;
        p++;
        if (p < end && (*p == 'B' || *p == 'b'))
            p++;
    }
    if (p != end || (shift && v > (~0ULL >> shift)))
        return false;
    *out = v << shift;
    return true;
}

/* The limit the tenant's value gives device 0, or 0 if it gives none. */
static unsigned long long asked_limit(const char *spec)
{
    for (const char *p = spec; p && *p;) {
        const char *comma = strchr(p, ',');
        const char *end = comma ? comma : p + strlen(p);
        unsigned long long v;
        if (end - p > 2 && p[0] == '0' && p[1] == '=' && parse_size(p + 2, end, &v))
            return v;
        p = comma ? comma + 1 : NULL;
    }
    return 0;
}

static void lower_percent(unsigned core)
{
    const char *cur = getenv(MPS_PERCENT_ENV);
    if (cur) {
        char *end;
        double v = strtod(cur, &end);
        if (end != cur && *end == '\0' && v > 0.0 && v <= (double)core)
            return; /* already within the share */
    }
    char buf[16];
    snprintf(buf, sizeof(buf), "%u", core);
    setenv(MPS_PERCENT_ENV, buf, 1);
}

static void lower_mem_limit(unsigned long long limit)
{
    unsigned long long asked = asked_limit(getenv(MPS_MEM_LIMIT_ENV));
    if (asked && asked <= limit)
        return;
    char buf[48];
    snprintf(buf, sizeof(buf), "0=%lluM", limit >> 20 ? limit >> 20 : 1);
    setenv(MPS_MEM_LIMIT_ENV, buf, 1);
}

__attribute__((constructor)) static void cgpu_mps_env(void)
{
    if (!will_be_mps_client())
        return;
    const char *dir = cgpu_region_dir();
    struct cgpu_region_file f;
    char err[256];
    if (!dir || cgpu_region_file_map(dir, CGPU_LIMITS_FILE, O_RDONLY, 0, &f, err, sizeof(err)) != 0)
        return; /* no region: nothing to enforce (a broken one fails at init) */
    close(f.fd);
    const struct cgpu_limits *l = f.addr;
    if (cgpu_limits_check(l, f.size, err, sizeof(err)) == 0 && l->device_count == 1) {
        if (l->device[0].core_percent)
            lower_percent(l->device[0].core_percent);
        if (l->device[0].mem_limit)
            lower_mem_limit(l->device[0].mem_limit);
    }
    munmap(f.addr, f.size);
}
