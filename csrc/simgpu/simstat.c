/* cgpu-sim-stat: the simulated GPUs' shared state as one JSON object, for
 * tests and for people looking at a demo.
 *
 *   cgpu-sim-stat                       GPUs, live processes, now_ns
 *   cgpu-sim-stat --busy GPU FROM TO    device busy ns in [FROM, TO)
 *
 * Times are CLOCK_MONOTONIC ns, the clock of the state's records. Reaps dead
 * processes first, as any user of the state may. Exit 1 if the state cannot
 * be attached, 2 on a usage error; one line on stderr either way. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void print_state(struct sim_handle *h)
{
    const struct sim_state *st = h->st;
    unsigned int ngpu = st->config.gpu_count < SIM_MAX_GPUS ? st->config.gpu_count : SIM_MAX_GPUS;
    printf("{\"gpus\":[");
    for (unsigned int g = 0; g < ngpu; g++) {
        const struct sim_gpu_config *c = &st->config.gpu[g];
        printf("%s{\"index\":%u,\"uuid\":", g ? "," : "", g);
        json_string(c->uuid, sizeof(c->uuid));
        printf(",\"name\":");
        json_string(c->name, sizeof(c->name));
        printf(",\"total\":%" PRIu64 ",\"used\":%" PRIu64 ",\"busy_total_ns\":%" PRIu64 "}", c->total_mem,
               atomic_load(&st->gpu[g].used), atomic_load(&st->gpu[g].busy_total));
    }
    printf("],\"procs\":[");
    int first = 1;
    for (int i = 0; i < SIM_MAX_PROCS; i++) {
        const struct sim_proc_slot *s = &st->proc[i];
        if (atomic_load(&s->state) != SIM_SLOT_LIVE)
            continue;
        char comm[sizeof(s->comm)];
        memcpy(comm, s->comm, sizeof(comm));
        printf("%s{\"slot\":%d,\"pid\":%" PRId32 ",\"comm\":", first ? "" : ",", i, atomic_load(&s->pid));
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

static void print_busy(const struct sim_state *st, int gpu, uint64_t from, uint64_t to)
{
    static struct sim_pid_busy per[SIM_MAX_PROCS];
    uint64_t busy;
    int n;
    bool complete = sim_busy_between(st, gpu, from, to, &busy, per, SIM_MAX_PROCS, &n);
    printf("{\"busy_ns\":%" PRIu64 ",\"per_pid\":{", busy);
    for (int i = 0; i < n; i++)
        printf("%s\"%d\":%" PRIu64, i ? "," : "", (int)per[i].pid, per[i].ns);
    printf("},\"complete\":%s}\n", complete ? "true" : "false");
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

int main(int argc, char **argv)
{
    uint64_t gpu = 0, from = 0, to = 0;
    int busy = argc > 1 && strcmp(argv[1], "--busy") == 0;
    if ((argc != 1 && !busy) ||
        (busy && (argc != 5 || parse_u64(argv[2], &gpu) || parse_u64(argv[3], &from) || parse_u64(argv[4], &to)))) {
        fprintf(stderr, "usage: cgpu-sim-stat [--busy GPU FROM_NS TO_NS]\n");
        return 2;
    }
    struct sim_handle h;
    char err[512];
    if (sim_attach(&h, err, sizeof(err)) != 0) {
        fprintf(stderr, "cgpu-sim-stat: %s\n", err);
        return 1;
    }
    if (busy && gpu >= h.st->config.gpu_count) {
        fprintf(stderr, "cgpu-sim-stat: no GPU %" PRIu64 ": the machine has %u\n", gpu, h.st->config.gpu_count);
        sim_detach(&h);
        return 2;
    }
    sim_reap_dead(&h);
    if (busy)
        print_busy(h.st, (int)gpu, from, to);
    else
        print_state(&h);
    sim_detach(&h);
    return fflush(stdout) == 0 ? 0 : 1;
}
