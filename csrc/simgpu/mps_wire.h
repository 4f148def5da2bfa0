/* The simulated MPS: what the simulated driver (mps_client.c), the control
 * daemon (mps_control.c) and the server (mps_server.c) say to each other
 * over the control socket in the pipe directory. The names users see are
 * NVIDIA's (the executables, CUDA_MPS_* variables, `control`, the pid
 * file, the commands); the lines below between our own parts are not, and
 * start with '\x01' so no typed command can look like one.
 *
 *   client -> control  "\x01CLIENT <slot> <generation>\n"
 *   control -> client  "OK <server slot> <server generation>\n" | "ERR <CUresult>\n"
 *                      (the connection stays open while the client lives)
 *   server -> control  "\x01SERVER\n"
 *   control -> server  "CONFIG <percent> <limit of ordinal 0> ... <limit of ordinal 15>\n"
 *   server -> control  "READY <slot> <generation>\n" | "FAIL <CUresult> <reason>\n"
 *   control -> server  "quit\n" (or closing the connection) ends it
 *   anyone  -> control  a command line; the answer, then the daemon closes */
#ifndef CGPU_SIM_MPS_WIRE_H
#define CGPU_SIM_MPS_WIRE_H

#include <stdbool.h>
#include <stdint.h>

#define MPS_PIPE_ENV "CUDA_MPS_PIPE_DIRECTORY"
#define MPS_LOG_ENV "CUDA_MPS_LOG_DIRECTORY"
#define MPS_PERCENT_ENV "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
#define MPS_MEM_LIMIT_ENV "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
#define MPS_DEFAULT_PIPE "/tmp/nvidia-mps"
#define MPS_DEFAULT_LOG "/var/log/nvidia-mps"
#define MPS_CONTROL_SOCKET "control"
#define MPS_PID_FILE "nvidia-cuda-mps-control.pid"
#define MPS_SERVER_EXE "nvidia-cuda-mps-server"
#define MPS_LINE_MAX 1024
#define MPS_MAX_DEVICES 16
/* How long a client waits for its server before CUDA_ERROR_MPS_SERVER_NOT_READY. */
#define MPS_CLIENT_WAIT_MS 10000

#define MPS_HELLO_CLIENT "\x01" "CLIENT"
#define MPS_HELLO_SERVER "\x01" "SERVER"

/* A memory size as MPS writes it: a number with an optional K, M, G or T
 * (an optional B after it): "2G", "512MB", "1048576". 0 on success. */
static inline int mps_parse_size(const char *s, uint64_t *out)
{
    uint64_t v = 0;
    const char *p = s;
    if (*p < '0' || *p > '9')
        return -1;
    for (; *p >= '0' && *p <= '9'; p++) {
        if (v > (UINT64_MAX - 9) / 10)
            return -1;
        v = v * 10 + (uint64_t)(*p - '0');
    }
    unsigned shift = 0;
    switch (*p) {
    case 'K': case 'k': shift = 10; p++; break;
    case 'M': case 'm': shift = 20; p++; break;
    case 'G': case 'g': shift = 30; p++; break;
    case 'T': case 't': shift = 40; p++; break;
    default: break;
    }
    if (shift && (*p == 'B' || *p == 'b'))
        p++;
    if (*p != '\0' || (shift && v > (UINT64_MAX >> shift)))
        return -1;
    *out = v << shift;
    return 0;
}

/* CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: "<ordinal>=<size>" pairs separated by
 * commas ("0=1G,1=512M"). Fills limits[ordinal] (0: none); false if any
 * pair is malformed, and then nothing is set. */
bool mps_parse_mem_limits(const char *spec, uint64_t limits[MPS_MAX_DEVICES]);

/* CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: a number in (0, 100] (a fraction is
 * taken down to whole percent, at least 1); 0 if malformed. */
uint32_t mps_parse_percent(const char *s);

#endif
