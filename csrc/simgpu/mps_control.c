/* nvidia-cuda-mps-control of the simulated GPUs, as NVIDIA's behaves:
 *
 *   nvidia-cuda-mps-control -d   daemon (background; ready when it returns)
 *   nvidia-cuda-mps-control -f   daemon in the foreground
 *   nvidia-cuda-mps-control      commands from stdin, one a line, to the
 *                                daemon of CUDA_MPS_PIPE_DIRECTORY
 *
 * The daemon listens on <pipe dir>/control, writes its pid to
 * <pipe dir>/nvidia-cuda-mps-control.pid and logs to
 * <CUDA_MPS_LOG_DIRECTORY>/control.log. A client that connects makes it
 * start nvidia-cuda-mps-server (found beside this program) under the
 * client's user id, unless one of that user runs; a client of another user
 * waits until the running server has no clients left, which then stops.
 * Its environment's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and
 * CUDA_MPS_PINNED_DEVICE_MEM_LIMIT are the defaults new servers get, as
 * are the set_default_* commands. Commands: get_server_list,
 * get_client_list PID, set/get_default_active_thread_percentage,
 * set/get_default_device_pinned_mem_limit, quit. Protocol: mps_wire.h. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cgpu/cuda_abi.h"
#include "mps_wire.h"
#include "simstate.h"

#define MAX_CONNS 128
#define COMMAND_TIMEOUT_MS 5000
#define QUIT_WAIT_MS 5000

enum conn_kind { C_FREE, C_NEW, C_PENDING, C_CLIENT, C_SERVER };

struct conn {
    enum conn_kind kind;
    int fd;
    pid_t pid;
    uid_t uid;
    gid_t gid;
    uint64_t deadline; /* a pending client's, or a command's */
    size_t len;
    char buf[MPS_LINE_MAX];
};

struct daemon {
    char dir[PATH_MAX];
    char sock[sizeof(((struct sockaddr_un *)0)->sun_path)];
    char pidfile[PATH_MAX + 64];
    int listen_fd;
    FILE *log;
    uint32_t default_pct;
    uint64_t default_limits[MPS_MAX_DEVICES];
    pid_t server_pid;     /* 0: none */
    uid_t server_uid;
    gid_t server_gid;
    int server_conn;      /* index in conns, -1 until it says hello */
    bool server_ready;
    bool server_quitting;
    int server_slot;
    unsigned long long server_gen;
    struct conn conns[MAX_CONNS];
};

static void logmsg(struct daemon *d, const char *fmt, ...)
{
    if (!d->log)
        return;
    time_t t = time(NULL);
    struct tm tm;
    char when[32];
    strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", localtime_r(&t, &tm));
    fprintf(d->log, "[%s Control %d] ", when, (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    vfprintf(d->log, fmt, ap);
    va_end(ap);
    fputc('\n', d->log);
    fflush(d->log);
}

static uint64_t now_ms(void)
{
    return sim_now_ns() / 1000000ULL;
}

static void say(int fd, const char *fmt, ...)
{
    char line[MPS_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n > 0 && (size_t)n < sizeof(line))
        (void)!send(fd, line, (size_t)n, MSG_NOSIGNAL);
}

static void drop(struct daemon *d, int i)
{
    struct conn *c = &d->conns[i];
    if (c->kind == C_FREE)
        return;
    if (c->kind == C_CLIENT)
        logmsg(d, "Client %d disconnected", (int)c->pid);
    close(c->fd);
    c->kind = C_FREE;
    c->fd = -1;
    if (i == d->server_conn)
        d->server_conn = -1;
}

static int clients_of_server(const struct daemon *d)
{
    int n = 0;
    for (int i = 0; i < MAX_CONNS; i++)
        n += d->conns[i].kind == C_CLIENT;
    return n;
}

/* ---- the server ------------------------------------------------------------ */

static void start_server(struct daemon *d, uid_t uid, gid_t gid)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0)
        return;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash || (size_t)(slash - exe) + sizeof("/" MPS_SERVER_EXE) > sizeof(exe))
        return;
    strcpy(slash + 1, MPS_SERVER_EXE);
    pid_t pid = fork();
    if (pid < 0) {
        logmsg(d, "cannot start a server: %s", strerror(errno));
        return;
    }
    if (pid == 0) {
        if (getuid() == 0 && uid != 0 && (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0))
            _exit(126);
        setenv(MPS_PIPE_ENV, d->dir, 1);
        execl(exe, MPS_SERVER_EXE, (char *)NULL);
        _exit(127);
    }
    d->server_pid = pid;
    d->server_uid = uid;
    d->server_gid = gid;
    d->server_ready = false;
    d->server_quitting = false;
    d->server_conn = -1;
    logmsg(d, "Starting new server %d for user %u", (int)pid, (unsigned)uid);
}

static void stop_server(struct daemon *d)
{
    if (!d->server_pid || d->server_quitting)
        return;
    d->server_quitting = true;
    if (d->server_conn >= 0)
        say(d->conns[d->server_conn].fd, "quit\n");
    else
        kill(d->server_pid, SIGTERM);
    logmsg(d, "Stopping server %d", (int)d->server_pid);
}

static void readable(struct daemon *d, int i);

static void server_gone(struct daemon *d)
{
    /* A FAIL it wrote just before it exited may be unread yet (the exit
     * was seen first): its reason, not "not ready", is the clients' answer. */
    if (d->server_conn >= 0)
        readable(d, d->server_conn);
    logmsg(d, "Server %d exited", (int)d->server_pid);
    if (!d->server_ready) {
        /* It died starting: its waiting clients fail now, rather than the
         * daemon starting one server after another until they give up. */
        for (int i = 0; i < MAX_CONNS; i++) {
            if (d->conns[i].kind == C_PENDING && d->conns[i].uid == d->server_uid) {
                say(d->conns[i].fd, "ERR %d\n", (int)CUDA_ERROR_MPS_SERVER_NOT_READY);
                drop(d, i);
            }
        }
    }
    d->server_pid = 0;
    d->server_ready = false;
    d->server_quitting = false;
    if (d->server_conn >= 0)
        drop(d, d->server_conn);
    /* Its clients lost their server: the driver fails their calls. */
    for (int i = 0; i < MAX_CONNS; i++)
        if (d->conns[i].kind == C_CLIENT)
            drop(d, i);
}

static void reap(struct daemon *d)
{
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
        if (pid == d->server_pid)
            server_gone(d);
}

/* Pending clients: answered once a server of their user is ready, failed
 * past their deadline; a server of another user is stopped once idle. */
static void serve_pending(struct daemon *d)
{
    uint64_t now = now_ms();
    int first = -1;
    for (int i = 0; i < MAX_CONNS; i++) {
        struct conn *c = &d->conns[i];
        if (c->kind != C_PENDING)
            continue;
        if (d->server_ready && !d->server_quitting && c->uid == d->server_uid) {
            say(c->fd, "OK %d %llu\n", d->server_slot, d->server_gen);
            c->kind = C_CLIENT;
            logmsg(d, "NEW CLIENT %d from user %u: connected to server %d", (int)c->pid, (unsigned)c->uid,
                   (int)d->server_pid);
        } else if (now >= c->deadline) {
            say(c->fd, "ERR %d\n", (int)CUDA_ERROR_MPS_SERVER_NOT_READY);
            drop(d, i);
        } else if (first < 0) {
            first = i;
        }
    }
    if (first < 0)
        return;
    if (!d->server_pid)
        start_server(d, d->conns[first].uid, d->conns[first].gid);
    else if (d->server_ready && d->conns[first].uid != d->server_uid && clients_of_server(d) == 0)
        stop_server(d);
}

static void server_line(struct daemon *d, int i, const char *line)
{
    int slot, code;
    unsigned long long gen;
    if (sscanf(line, "READY %d %llu", &slot, &gen) == 2) {
        d->server_ready = true;
        d->server_slot = slot;
        d->server_gen = gen;
        logmsg(d, "NEW SERVER %d: Ready", (int)d->server_pid);
    } else if (sscanf(line, "FAIL %d", &code) == 1) {
        logmsg(d, "Server %d failed to start: %s", (int)d->server_pid, line);
        for (int k = 0; k < MAX_CONNS; k++) {
            if (d->conns[k].kind == C_PENDING && d->conns[k].uid == d->server_uid) {
                say(d->conns[k].fd, "ERR %d\n", code);
                drop(d, k);
            }
        }
        drop(d, i);
    }
}

/* ---- commands ---------------------------------------------------------------- */

static bool quit_requested;

static void command(struct daemon *d, struct conn *c, char *line)
{
    char *save = NULL;
    char *verb = strtok_r(line, " \t", &save);
    char *a1 = verb ? strtok_r(NULL, " \t", &save) : NULL;
    char *a2 = a1 ? strtok_r(NULL, " \t", &save) : NULL;
    if (!verb) {
        return;
    } else if (c->uid != 0 && c->uid != getuid()) {
        say(c->fd, "Permission denied\n");
    } else if (strcmp(verb, "quit") == 0) {
        logmsg(d, "Received quit command");
        quit_requested = true;
    } else if (strcmp(verb, "get_server_list") == 0) {
        if (d->server_pid && d->server_ready)
            say(c->fd, "%d\n", (int)d->server_pid);
    } else if (strcmp(verb, "get_client_list") == 0) {
        if (a1 && d->server_pid && atoi(a1) == (int)d->server_pid)
            for (int i = 0; i < MAX_CONNS; i++)
                if (d->conns[i].kind == C_CLIENT)
                    say(c->fd, "%d\n", (int)d->conns[i].pid);
    } else if (strcmp(verb, "set_default_active_thread_percentage") == 0) {
        uint32_t p = a1 ? mps_parse_percent(a1) : 0;
        if (!p) {
            say(c->fd, "Invalid percentage\n");
        } else {
            d->default_pct = p;
            logmsg(d, "Default active thread percentage set to %u.0", p);
            say(c->fd, "%u.0\n", p);
        }
    } else if (strcmp(verb, "get_default_active_thread_percentage") == 0) {
        say(c->fd, "%u.0\n", d->default_pct);
    } else if (strcmp(verb, "set_default_device_pinned_mem_limit") == 0) {
        int dev = a1 ? atoi(a1) : -1;
        uint64_t v;
        if (!a1 || !a2 || dev < 0 || dev >= MPS_MAX_DEVICES || mps_parse_size(a2, &v) != 0) {
            say(c->fd, "Invalid device or limit\n");
        } else {
            d->default_limits[dev] = v;
            logmsg(d, "Default pinned memory limit of device %d set to %s", dev, a2);
        }
    } else if (strcmp(verb, "get_default_device_pinned_mem_limit") == 0) {
        int dev = a1 ? atoi(a1) : -1;
        if (dev < 0 || dev >= MPS_MAX_DEVICES)
            say(c->fd, "Invalid device\n");
        else
            say(c->fd, "%lluM\n", (unsigned long long)(d->default_limits[dev] >> 20));
    } else {
        say(c->fd, "Unknown command %s\n", verb);
    }
}

/* ---- connections ------------------------------------------------------------ */

static void first_line(struct daemon *d, int i, char *line)
{
    struct conn *c = &d->conns[i];
    size_t hc = strlen(MPS_HELLO_CLIENT), hs = strlen(MPS_HELLO_SERVER);
    if (strncmp(line, MPS_HELLO_CLIENT, hc) == 0 && (line[hc] == ' ' || line[hc] == '\0')) {
        c->kind = C_PENDING;
        c->deadline = now_ms() + MPS_CLIENT_WAIT_MS;
        logmsg(d, "Accepting client %d from user %u", (int)c->pid, (unsigned)c->uid);
    } else if (strncmp(line, MPS_HELLO_SERVER, hs) == 0 && line[hs] == '\0') {
        if (c->pid != d->server_pid || d->server_conn >= 0) {
            drop(d, i);
            return;
        }
        c->kind = C_SERVER;
        d->server_conn = i;
        char cfg[MPS_LINE_MAX];
        int n = snprintf(cfg, sizeof(cfg), "CONFIG %u", d->default_pct);
        for (int k = 0; k < MPS_MAX_DEVICES && n > 0 && (size_t)n < sizeof(cfg); k++)
            n += snprintf(cfg + n, sizeof(cfg) - (size_t)n, " %llu", (unsigned long long)d->default_limits[k]);
        say(c->fd, "%s\n", cfg);
    } else {
        command(d, c, line);
        drop(d, i);
    }
}

static void readable(struct daemon *d, int i)
{
    struct conn *c = &d->conns[i];
    ssize_t got = recv(c->fd, c->buf + c->len, sizeof(c->buf) - 1 - c->len, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
        if (c->kind == C_SERVER)
            d->server_conn = -1;
        drop(d, i);
        return;
    }
    if (got < 0)
        return;
    c->len += (size_t)got;
    char *nl;
    while (c->kind != C_FREE && (nl = memchr(c->buf, '\n', c->len)) != NULL) {
        *nl = '\0';
        char line[MPS_LINE_MAX];
        memcpy(line, c->buf, (size_t)(nl - c->buf) + 1);
        c->len -= (size_t)(nl - c->buf) + 1;
        memmove(c->buf, nl + 1, c->len);
        if (c->kind == C_NEW)
            first_line(d, i, line);
        else if (c->kind == C_SERVER)
            server_line(d, i, line);
        /* clients and pending clients say nothing more */
    }
    if (c->kind != C_FREE && c->len == sizeof(c->buf) - 1)
        drop(d, i); /* a line longer than any the protocol has */
}

static void accept_one(struct daemon *d)
{
    int fd = accept4(d->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0)
        return;
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        close(fd);
        return;
    }
    for (int i = 0; i < MAX_CONNS; i++) {
        if (d->conns[i].kind == C_FREE) {
            d->conns[i] = (struct conn){.kind = C_NEW, .fd = fd, .pid = cred.pid, .uid = cred.uid, .gid = cred.gid,
                                        .deadline = now_ms() + COMMAND_TIMEOUT_MS};
            return;
        }
    }
    logmsg(d, "Too many connections; refusing one from pid %d", (int)cred.pid);
    close(fd);
}

static void expire_new(struct daemon *d)
{
    uint64_t now = now_ms();
    for (int i = 0; i < MAX_CONNS; i++)
        if (d->conns[i].kind == C_NEW && now >= d->conns[i].deadline)
            drop(d, i);
}

static void shutdown_daemon(struct daemon *d)
{
    stop_server(d);
    uint64_t until = now_ms() + QUIT_WAIT_MS;
    while (d->server_pid && now_ms() < until) {
        reap(d);
        usleep(10000);
    }
    if (d->server_pid) {
        kill(d->server_pid, SIGKILL);
        waitpid(d->server_pid, NULL, 0);
    }
    for (int i = 0; i < MAX_CONNS; i++)
        drop(d, i);
    unlink(d->sock);
    unlink(d->pidfile);
    logmsg(d, "Exit");
}

static int serve(struct daemon *d)
{
    while (!quit_requested) {
        struct pollfd fds[MAX_CONNS + 1];
        int map[MAX_CONNS + 1];
        int n = 0;
        fds[n] = (struct pollfd){.fd = d->listen_fd, .events = POLLIN};
        map[n++] = -1;
        for (int i = 0; i < MAX_CONNS; i++) {
            if (d->conns[i].kind != C_FREE) {
                fds[n] = (struct pollfd){.fd = d->conns[i].fd, .events = POLLIN};
                map[n++] = i;
            }
        }
        int r = poll(fds, (nfds_t)n, 50);
        if (r < 0 && errno != EINTR)
            return 1;
        for (int k = 0; r > 0 && k < n; k++) {
            if (!fds[k].revents)
                continue;
            if (map[k] < 0)
                accept_one(d);
            else if (d->conns[map[k]].kind != C_FREE && d->conns[map[k]].fd == fds[k].fd)
                readable(d, map[k]);
        }
        reap(d);
        expire_new(d);
        serve_pending(d);
    }
    shutdown_daemon(d);
    return 0;
}

/* ---- start-up ------------------------------------------------------------------ */

static int listen_control(struct daemon *d)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, d->sock, sizeof(addr.sun_path));
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe >= 0 && connect(probe, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
        close(probe);
        fprintf(stderr, "An instance of this daemon is already running in %s\n", d->dir);
        return -1;
    }
    if (probe >= 0)
        close(probe);
    unlink(d->sock); /* stale: nobody listens */
    d->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (d->listen_fd < 0 || bind(d->listen_fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 ||
        listen(d->listen_fd, 64) != 0) {
        fprintf(stderr, "cannot listen on %s: %s\n", d->sock, strerror(errno));
        return -1;
    }
    /* Clients of every user connect: the daemon starts a server per user. */
    (void)chmod(d->sock, 0777);
    return 0;
}

static int write_pidfile(struct daemon *d)
{
    char tmp[sizeof(d->pidfile) + 8];
    snprintf(tmp, sizeof(tmp), "%s.tmp", d->pidfile);
    FILE *f = fopen(tmp, "we");
    if (!f || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f) != 0 || rename(tmp, d->pidfile) != 0) {
        fprintf(stderr, "cannot write %s: %s\n", d->pidfile, strerror(errno));
        return -1;
    }
    return 0;
}

static int setup(struct daemon *d)
{
    const char *dir = getenv(MPS_PIPE_ENV), *logdir = getenv(MPS_LOG_ENV);
    dir = dir && *dir ? dir : MPS_DEFAULT_PIPE;
    logdir = logdir && *logdir ? logdir : MPS_DEFAULT_LOG;
    if (snprintf(d->dir, sizeof(d->dir), "%s", dir) >= (int)sizeof(d->dir) ||
        snprintf(d->sock, sizeof(d->sock), "%s/%s", dir, MPS_CONTROL_SOCKET) >= (int)sizeof(d->sock)) {
        fprintf(stderr, "pipe directory path too long: %s\n", dir);
        return -1;
    }
    snprintf(d->pidfile, sizeof(d->pidfile), "%s/%s", dir, MPS_PID_FILE);
    (void)mkdir(dir, 0755);
    (void)mkdir(logdir, 0755);
    char logpath[PATH_MAX + 16];
    snprintf(logpath, sizeof(logpath), "%s/control.log", logdir);
    d->log = fopen(logpath, "ae");
    d->default_pct = 100;
    const char *pct = getenv(MPS_PERCENT_ENV), *lim = getenv(MPS_MEM_LIMIT_ENV);
    if (pct && !(d->default_pct = mps_parse_percent(pct))) {
        fprintf(stderr, "invalid %s=%s\n", MPS_PERCENT_ENV, pct);
        return -1;
    }
    if (lim && !mps_parse_mem_limits(lim, d->default_limits)) {
        fprintf(stderr, "invalid %s=%s\n", MPS_MEM_LIMIT_ENV, lim);
        return -1;
    }
    d->server_conn = -1;
    for (int i = 0; i < MAX_CONNS; i++)
        d->conns[i] = (struct conn){.kind = C_FREE, .fd = -1};
    return listen_control(d);
}

/* The background daemon: ready (socket and pid file there) before -d returns. */
static int daemonize(struct daemon *d)
{
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) != 0)
        return 1;
    pid_t pid = fork();
    if (pid < 0)
        return 1;
    if (pid > 0) {
        close(ready[1]);
        char ok = 0;
        ssize_t got;
        while ((got = read(ready[0], &ok, 1)) < 0 && errno == EINTR) {
        }
        return got == 1 && ok == 1 ? 0 : 1;
    }
    close(ready[0]);
    setsid();
    if (setup(d) != 0 || write_pidfile(d) != 0)
        _exit(1);
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
    }
    logmsg(d, "Starting control daemon using socket %s", d->sock);
    char ok = 1;
    (void)!write(ready[1], &ok, 1);
    close(ready[1]);
    _exit(serve(d));
}

/* Command mode: each stdin line to the daemon, its answer to stdout. */
static int commands(void)
{
    const char *dir = getenv(MPS_PIPE_ENV);
    dir = dir && *dir ? dir : MPS_DEFAULT_PIPE;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (snprintf(addr.sun_path, sizeof(addr.sun_path), "%s/%s", dir, MPS_CONTROL_SOCKET) >=
        (int)sizeof(addr.sun_path))
        return 1;
    char line[MPS_LINE_MAX];
    int rc = 0;
    while (fgets(line, sizeof(line), stdin)) {
        if (line[0] == '\x01' || line[strspn(line, " \t\n")] == '\0')
            continue;
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
            fprintf(stderr, "Cannot find MPS control daemon process\n");
            if (fd >= 0)
                close(fd);
            return 1;
        }
        size_t len = strlen(line);
        if (line[len - 1] != '\n' && len + 1 < sizeof(line)) {
            line[len++] = '\n';
            line[len] = '\0';
        }
        if (send(fd, line, len, MSG_NOSIGNAL) != (ssize_t)len)
            rc = 1;
        char buf[4096];
        ssize_t got;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        while (poll(&p, 1, COMMAND_TIMEOUT_MS) > 0 && (got = read(fd, buf, sizeof(buf))) > 0)
            fwrite(buf, 1, (size_t)got, stdout);
        fflush(stdout);
        close(fd);
    }
    return rc;
}

int main(int argc, char **argv)
{
    static struct daemon d;
    signal(SIGPIPE, SIG_IGN);
    if (argc == 1)
        return commands();
    if (argc == 2 && strcmp(argv[1], "-d") == 0)
        return daemonize(&d);
    if (argc == 2 && strcmp(argv[1], "-f") == 0) {
        if (setup(&d) != 0 || write_pidfile(&d) != 0)
            return 1;
        logmsg(&d, "Starting control daemon using socket %s", d.sock);
        return serve(&d);
    }
    fprintf(stderr, "usage: nvidia-cuda-mps-control [-d | -f]\n");
    return 2;
}
