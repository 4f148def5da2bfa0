/* nvidia-cuda-mps-server of the simulated GPUs. The control daemon starts
 * it (with the daemon's environment: CUDA_VISIBLE_DEVICES chooses its
 * GPUs) when a client asks for one. It holds the one context per GPU that
 * EXCLUSIVE_PROCESS allows, with the active thread percentage and pinned
 * memory limits the daemon gives it, which its clients read from its
 * process slot. It lives until the daemon says quit or goes away. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "cgpu/cuda_abi.h"
#include "mps_wire.h"
#include "simstate.h"

static FILE *logf;

static void logmsg(const char *fmt, ...)
{
    if (!logf)
        return;
    time_t t = time(NULL);
    struct tm tm;
    char when[32];
    strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", localtime_r(&t, &tm));
    fprintf(logf, "[%s Server %d] ", when, (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    vfprintf(logf, fmt, ap);
    va_end(ap);
    fputc('\n', logf);
    fflush(logf);
}

static int visible_gpu(const struct sim_config *cfg, const char *entry)
{
    if (strncmp(entry, "GPU-", 4) == 0) {
        int found = -1;
        for (unsigned i = 0; i < cfg->gpu_count; i++) {
            if (strncasecmp(cfg->gpu[i].uuid, entry, strlen(entry)) == 0) {
                if (found >= 0)
                    return -1;
                found = (int)i;
            }
        }
        return found;
    }
    char *end;
    long idx = strtol(entry, &end, 10);
    return end != entry && *end == '\0' && idx >= 0 && idx < (long)cfg->gpu_count ? (int)idx : -1;
}

/* The server's GPUs in ordinal order, as the driver reads CUDA_VISIBLE_DEVICES. */
static int server_gpus(const struct sim_config *cfg, int *gpus)
{
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    int n = 0;
    if (!env) {
        for (unsigned i = 0; i < cfg->gpu_count; i++)
            gpus[n++] = (int)i;
        return n;
    }
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", env);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && n < SIM_MAX_GPUS;
         tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        int g = visible_gpu(cfg, tok);
        bool seen = false;
        for (int i = 0; i < n; i++)
            seen = seen || gpus[i] == g;
        if (g < 0 || seen)
            break;
        gpus[n++] = g;
    }
    return n;
}

static int connect_control(const char *dir)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof(addr.sun_path), "%s/%s", dir, MPS_CONTROL_SOCKET) >=
        (int)sizeof(addr.sun_path))
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static bool read_line(int fd, char *buf, size_t len)
{
    size_t n = 0;
    while (n + 1 < len) {
        ssize_t got = read(fd, buf + n, 1);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return false;
        if (buf[n] == '\n') {
            buf[n] = '\0';
            return true;
        }
        n++;
    }
    return false;
}

static void say(int fd, const char *fmt, ...)
{
    char line[MPS_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n > 0 && (size_t)n < sizeof(line) && write(fd, line, (size_t)n) != n)
        logmsg("cannot write to the control daemon: %s", strerror(errno));
}

/* "CONFIG <pct> <limit 0> ... <limit 15>" */
static bool parse_config(char *line, uint32_t *pct, uint64_t limits[MPS_MAX_DEVICES])
{
    char *save = NULL, *tok = strtok_r(line, " ", &save);
    if (!tok || strcmp(tok, "CONFIG") != 0 || !(tok = strtok_r(NULL, " ", &save)))
        return false;
    *pct = mps_parse_percent(tok);
    for (int i = 0; i < MPS_MAX_DEVICES; i++) {
        if (!(tok = strtok_r(NULL, " ", &save)) || mps_parse_size(tok, &limits[i]) != 0)
            return false;
    }
    return *pct > 0;
}

int main(void)
{
    const char *dir = getenv(MPS_PIPE_ENV);
    const char *logdir = getenv(MPS_LOG_ENV);
    dir = dir && *dir ? dir : MPS_DEFAULT_PIPE;
    char path[4096];
    snprintf(path, sizeof(path), "%s/server.log", logdir && *logdir ? logdir : MPS_DEFAULT_LOG);
    logf = fopen(path, "ae");
    logmsg("Startup");
    int fd = connect_control(dir);
    if (fd < 0) {
        logmsg("cannot connect to the control daemon in %s: %s", dir, strerror(errno));
        return 1;
    }
    say(fd, "%s\n", MPS_HELLO_SERVER);
    char line[MPS_LINE_MAX];
    uint32_t pct = 0;
    uint64_t limits[MPS_MAX_DEVICES] = {0};
    if (!read_line(fd, line, sizeof(line)) || !parse_config(line, &pct, limits)) {
        logmsg("no configuration from the control daemon");
        return 1;
    }
    struct sim_handle h;
    char err[512];
    if (sim_attach(&h, err, sizeof(err)) != 0 || sim_claim_slot(&h) != 0) {
        say(fd, "FAIL %d %s\n", (int)CUDA_ERROR_NO_DEVICE, "no simulated GPU");
        logmsg("%s", err);
        return 1;
    }
    struct sim_proc_slot *me = &h.st->proc[h.slot];
    atomic_store(&me->mps_pct, pct);
    atomic_store(&me->mps_role, SIM_MPS_SERVER);
    int gpus[SIM_MAX_GPUS];
    int n = server_gpus(&h.st->config, gpus);
    if (n == 0) {
        say(fd, "FAIL %d %s\n", (int)CUDA_ERROR_NO_DEVICE, "no GPU visible");
        return 1;
    }
    for (int i = 0; i < n; i++) {
        logmsg("Creating server context on device %d (%s)", i, h.st->config.gpu[gpus[i]].name);
        int rc = sim_use_gpu(&h, gpus[i], h.st->config.context_bytes);
        if (rc != 0) {
            CUresult cu = rc == -1 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_DEVICE_UNAVAILABLE;
            say(fd, "FAIL %d %s\n", (int)cu, "cannot create a context on the GPU");
            logmsg("Server failed to create a context on device %d: error %d", i, (int)cu);
            return 1;
        }
        atomic_store(&me->mps_mem_limit[gpus[i]], i < MPS_MAX_DEVICES ? limits[i] : 0);
        if (i < MPS_MAX_DEVICES && limits[i])
            logmsg("Device pinned memory limit for device %d set to %llu bytes", i, (unsigned long long)limits[i]);
    }
    logmsg("Active Threads Percentage set to %u.0", pct);
    say(fd, "READY %d %llu\n", h.slot, (unsigned long long)atomic_load(&me->generation));
    logmsg("Server has started");
    /* Until quit or the daemon goes: the process's exit frees the slot. */
    while (read_line(fd, line, sizeof(line))) {
        if (strcmp(line, "quit") == 0)
            break;
    }
    logmsg("Server exiting");
    return 0;
}
