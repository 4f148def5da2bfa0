/* Simulated libcuda.so.1 as an MPS client. At cuInit, as the real driver
 * does, it tries the control daemon's socket in CUDA_MPS_PIPE_DIRECTORY
 * (default /tmp/nvidia-mps): nobody there, and the process runs without
 * MPS; a daemon there, and it asks for a server and becomes its client.
 * A client sees only its server's GPUs; its kernels run beside the other
 * clients' within its active thread percentage (simstate.c), and its
 * device memory is bounded by the pinned memory limit. Its own
 * environment can only lower what the server was started with. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "driver.h"
#include "mps_wire.h"

static int control_fd = -1;

void sim_mps_forget(void)
{
    if (control_fd >= 0)
        close(control_fd);
    control_fd = -1;
}

/* One line from fd within the deadline; false on EOF, error or timeout. */
static bool read_line(int fd, char *buf, size_t len, int timeout_ms)
{
    size_t n = 0;
    uint64_t deadline = sim_now_ns() + (uint64_t)timeout_ms * 1000000ULL;
    while (n + 1 < len) {
        uint64_t now = sim_now_ns();
        if (now >= deadline)
            return false;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)((deadline - now) / 1000000ULL) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
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

static int connect_control(void)
{
    const char *dir = getenv(MPS_PIPE_ENV);
    if (!dir || !*dir)
        dir = MPS_DEFAULT_PIPE;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof(addr.sun_path), "%s/%s", dir, MPS_CONTROL_SOCKET) >=
        (int)sizeof(addr.sun_path))
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The server's GPUs become the client's: CUDA_VISIBLE_DEVICES as the
 * client reads it applies within them. */
static void keep_server_gpus(uint32_t server_mask)
{
    int n = 0;
    for (int i = 0; i < sim_drv.visible_count; i++)
        if ((server_mask >> sim_drv.visible[i]) & 1u)
            sim_drv.visible[n++] = sim_drv.visible[i];
    sim_drv.visible_count = n;
}

/* Limits from the server, lowered (never raised) by the client's own
 * environment, which names devices by the client's ordinals. */
static void take_limits(struct sim_proc_slot *me, const struct sim_proc_slot *srv)
{
    uint32_t pct = atomic_load(&srv->mps_pct);
    const char *env = getenv(MPS_PERCENT_ENV);
    uint32_t mine = env ? mps_parse_percent(env) : 0;
    if (mine && mine < pct)
        pct = mine;
    uint64_t asked[MPS_MAX_DEVICES] = {0};
    env = getenv(MPS_MEM_LIMIT_ENV);
    if (env && !mps_parse_mem_limits(env, asked))
        fprintf(stderr, "cgpu-sim: ignoring malformed %s=%s\n", MPS_MEM_LIMIT_ENV, env);
    for (int g = 0; g < SIM_MAX_GPUS; g++) {
        uint64_t lim = atomic_load(&srv->mps_mem_limit[g]);
        CUdevice ord = sim_ordinal(g);
        uint64_t a = ord >= 0 && ord < MPS_MAX_DEVICES ? asked[ord] : 0;
        if (a && (!lim || a < lim))
            lim = a;
        atomic_store(&me->mps_mem_limit[g], lim);
    }
    atomic_store(&me->mps_pct, pct);
}

CUresult sim_mps_attach(void)
{
    int fd = connect_control();
    if (fd < 0)
        return CUDA_SUCCESS; /* no daemon: not an MPS client */
    struct sim_handle *h = &sim_drv.shared;
    struct sim_proc_slot *me = &h->st->proc[h->slot];
    char line[MPS_LINE_MAX];
    int n = snprintf(line, sizeof(line), "%s %d %llu\n", MPS_HELLO_CLIENT, h->slot,
                     (unsigned long long)atomic_load(&me->generation));
    if (write(fd, line, (size_t)n) != n || !read_line(fd, line, sizeof(line), MPS_CLIENT_WAIT_MS)) {
        close(fd);
        fprintf(stderr, "cgpu-sim: the MPS control daemon did not answer\n");
        return CUDA_ERROR_MPS_CONNECTION_FAILED;
    }
    int srv_slot;
    unsigned long long srv_gen;
    int err;
    if (sscanf(line, "ERR %d", &err) == 1) {
        close(fd);
        return (CUresult)err;
    }
    if (sscanf(line, "OK %d %llu", &srv_slot, &srv_gen) != 2 || srv_slot < 0 || srv_slot >= SIM_MAX_PROCS) {
        close(fd);
        return CUDA_ERROR_MPS_CONNECTION_FAILED;
    }
    const struct sim_proc_slot *srv = &h->st->proc[srv_slot];
    if (atomic_load(&srv->generation) != srv_gen || atomic_load(&srv->mps_role) != SIM_MPS_SERVER) {
        close(fd);
        return CUDA_ERROR_MPS_SERVER_NOT_READY;
    }
    keep_server_gpus(atomic_load(&srv->gpu_mask));
    take_limits(me, srv);
    atomic_store(&me->mps_server, srv_slot);
    atomic_store(&me->mps_server_gen, srv_gen);
    atomic_store(&me->mps_role, SIM_MPS_CLIENT);
    control_fd = fd; /* held while the process lives: the server's client list */
    return CUDA_SUCCESS;
}

bool sim_mps_client(void)
{
    return atomic_load_explicit(&sim_drv.shared.st->proc[sim_drv.shared.slot].mps_role, memory_order_relaxed) ==
           SIM_MPS_CLIENT;
}

CUresult sim_mps_check(void)
{
    if (!sim_mps_client())
        return CUDA_SUCCESS;
    return sim_mps_client_live(sim_drv.shared.st, sim_drv.shared.slot) ? CUDA_SUCCESS
                                                                        : CUDA_ERROR_MPS_CLIENT_TERMINATED;
}
