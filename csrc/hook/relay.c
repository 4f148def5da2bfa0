/* The relay client: how cgpu-runtime and cgpu-hook ask cgpud. */
#define _GNU_SOURCE
#include "relay.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define RETRY_FIRST_MS 50
#define RETRY_MAX_MS 500

__attribute__((format(printf, 3, 4))) static int fail(char *msg, size_t size, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, size, fmt, ap);
    va_end(ap);
    return -1;
}

/* The answer ends up on a terminal and in runc's log: one line, no escapes. */
static void copy_printable(char *dst, size_t size, const char *src, size_t n)
{
    size_t i = 0;
    for (; i < n && i + 1 < size; i++) {
        unsigned char c = (unsigned char)src[i];
        dst[i] = (c < 0x20 || c == 0x7f) ? ' ' : (char)c;
    }
    dst[i] = '\0';
}

static int timed_out(const char *path, char *msg, size_t size)
{
    return fail(msg, size, "cgpud did not answer within %d s on %s", CGPU_RELAY_TIMEOUT_S, path);
}

static int send_all(int fd, const char *p, size_t len)
{
    while (len > 0) {
        /* MSG_NOSIGNAL: a daemon that hangs up must give an error, not kill us. */
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int parse_answer(const char *line, size_t len, const char *path, char *msg, size_t size)
{
    if (len == 2 && memcmp(line, "ok", 2) == 0) {
        msg[0] = '\0';
        return 0;
    }
    if (len >= 3 && memcmp(line, "ok ", 3) == 0) {
        copy_printable(msg, size, line + 3, len - 3);
        return 0;
    }
    if (len > 6 && memcmp(line, "error ", 6) == 0) {
        copy_printable(msg, size, line + 6, len - 6);
        return -1;
    }
    if ((len == 5 || len == 6) && memcmp(line, "error ", len) == 0)
        return fail(msg, size, "cgpud refused without giving a reason (on %s)", path);
    char shown[81];
    copy_printable(shown, sizeof(shown), line, len);
    return fail(msg, size, "cgpud sent an unexpected answer on %s: %s", path, shown);
}

static int went_away(const char *path, const char *why, char *msg, size_t size, int *gone)
{
    *gone = 1;
    return fail(msg, size, "cgpud went away without answering (%s: %s)", path, why);
}

static int read_answer(int fd, const char *path, int send_err, char *msg, size_t size, int *gone);

/* After a failed send cgpud may still have answered (e.g. it rejected the
 * request early and closed), so the answer is read either way. *gone is set
 * when cgpud closed or reset the connection without a byte of answer, as a
 * daemon that dies or restarts mid-request does: every request is safe to
 * send again (prepare and the hooks are idempotent for the same container
 * and instance; docs/containers.md). */
static int exchange(int fd, const char *path, const char *request, size_t len, char *msg, size_t size, int *gone)
{
    int send_err = 0;
    if (send_all(fd, request, len) < 0 || shutdown(fd, SHUT_WR) < 0)
        send_err = errno;
    if (send_err == EAGAIN) {
        *gone = 0;
        return timed_out(path, msg, size);
    }
    return read_answer(fd, path, send_err, msg, size, gone);
}

/* The answer to a request sent on fd; send_err: the errno of a failed send, or 0. */
static int read_answer(int fd, const char *path, int send_err, char *msg, size_t size, int *gone)
{
    *gone = 0;
    char line[CGPU_RELAY_MSG_MAX];
    size_t n = 0;
    const char *nl = NULL;
    while (!nl && n < sizeof(line)) {
        ssize_t r = recv(fd, line + n, sizeof(line) - n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EAGAIN)
            return timed_out(path, msg, size);
        if (r < 0 && n == 0 && errno == ECONNRESET)
            return went_away(path, strerror(errno), msg, size, gone);
        if (r < 0)
            return fail(msg, size, "lost the connection to cgpud at %s: %s", path,
                        strerror(send_err ? send_err : errno));
        if (r == 0)
            break;
        nl = memchr(line + n, '\n', (size_t)r);
        n += (size_t)r;
    }
    if (nl)
        return parse_answer(line, (size_t)(nl - line), path, msg, size);
    if (n == 0 && (send_err == 0 || send_err == EPIPE || send_err == ECONNRESET))
        return went_away(path, send_err ? strerror(send_err) : "connection closed", msg, size, gone);
    if (send_err)
        return fail(msg, size, "lost the connection to cgpud at %s: %s", path, strerror(send_err));
    if (n == sizeof(line))
        return fail(msg, size, "cgpud sent an answer longer than %zu bytes on %s", sizeof(line), path);
    return fail(msg, size, "cgpud sent an incomplete answer on %s", path);
}

/* A connection to cgpud with every step bounded, or -1 (msg says why;
 * *down set when cgpud is not there: socket missing or refusing). */
static int connect_relay(const struct sockaddr_un *addr, const char *path, char *msg, size_t size, int *down)
{
    *down = 0;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fail(msg, size, "cannot reach cgpud at %s: %s", path, strerror(errno));
    /* Bounds every step, connect included: a wedged daemon must not hang
     * container creation forever. */
    struct timeval tv = {.tv_sec = CGPU_RELAY_TIMEOUT_S};
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0) {
        int err = errno;
        close(fd);
        return fail(msg, size, "cannot reach cgpud at %s: %s", path, strerror(err));
    }
    if (connect(fd, (const struct sockaddr *)addr, sizeof(*addr)) < 0) {
        int err = errno;
        close(fd);
        if (err == EAGAIN)
            return timed_out(path, msg, size);
        /* ENOENT: cgpud stopped and removed its socket; ECONNREFUSED: it
         * died and left the socket behind. Anything else (EACCES, ...) is
         * not cured by waiting. */
        if (err == ENOENT || err == ECONNREFUSED) {
            *down = 1;
            return fail(msg, size, "cgpud is not running (%s: %s)", path, strerror(err));
        }
        return fail(msg, size, "cannot reach cgpud at %s: %s", path, strerror(err));
    }
    return fd;
}

/* One connection, one request. *down is set when cgpud was not there to
 * ask (socket missing or refusing) or went away before answering. */
static int attempt(const struct sockaddr_un *addr, const char *path, const char *request, size_t len, char *msg,
                   size_t size, int *down)
{
    int fd = connect_relay(addr, path, msg, size, down);
    if (fd < 0)
        return -1;
    int rc = exchange(fd, path, request, len, msg, size, down);
    close(fd);
    return rc;
}

/* The socket's address for a request of `len` bytes, or -1 with msg saying
 * why. */
static int relay_address(struct sockaddr_un *addr, const char *path, size_t len, char *msg, size_t size)
{
    if (len > CGPU_RELAY_MAX_REQUEST)
        return fail(msg, size, "request of %zu bytes is larger than the %d cgpud accepts", len,
                    CGPU_RELAY_MAX_REQUEST);
    size_t path_len = strlen(path);
    if (path_len >= sizeof(addr->sun_path))
        return fail(msg, size, "cannot reach cgpud at %s: socket path longer than %zu bytes", path,
                    sizeof(addr->sun_path) - 1);
    addr->sun_family = AF_UNIX;
    memcpy(addr->sun_path, path, path_len + 1);
    return 0;
}

/* The wait bound: CGPU_RELAY_WAIT_S, or less if CGPU_RELAY_WAIT_MS says so
 * (0: fail at once). Never more: a longer wait would outlast the timeouts
 * of runc and containerd, whose own message then says less than ours. */
static long wait_budget_ms(void)
{
    const long most = CGPU_RELAY_WAIT_S * 1000L;
    const char *v = getenv("CGPU_RELAY_WAIT_MS");
    if (!v || !*v)
        return most;
    char *end;
    errno = 0;
    long ms = strtol(v, &end, 10);
    if (errno || *end || ms < 0)
        return most;
    return ms < most ? ms : most;
}

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

/* `lost`: a first try, made elsewhere, found cgpud gone (msg says how). */
static int call(const char *prog, const char *path, const char *request, size_t len, char *msg, size_t size,
                int lost)
{
    struct sockaddr_un addr;
    if (relay_address(&addr, path, len, msg, size) < 0)
        return -1;

    const long budget = wait_budget_ms(), deadline = now_ms() + budget;
    long delay = RETRY_FIRST_MS;
    for (int tries = 0;; tries++) {
        int down = tries == 0 && lost, rc = -1;
        if (!down)
            rc = attempt(&addr, path, request, len, msg, size, &down);
        if (!down)
            return rc;
        long left = deadline - now_ms();
        if (left <= 0) {
            /* msg is at most size - 1 bytes, so the copy fits what fail() cuts. */
            char why[CGPU_RELAY_MSG_MAX];
            snprintf(why, sizeof(why), "%s", msg);
            if (tries == 0)
                return fail(msg, size, "%s: start it (systemctl start cgpud)", why);
            return fail(msg, size, "%s; it did not come back within %.3g s: start it (systemctl start cgpud)",
                        why, (double)budget / 1000.0);
        }
        /* One line, once: the start is slow on purpose, not hung. */
        if (tries == 0) {
            char note[CGPU_RELAY_MSG_MAX + 64];
            snprintf(note, sizeof(note), "%s; retrying for %.3g s", msg, (double)budget / 1000.0);
            cgpu_relay_report(prog, note);
        }
        sleep_ms(delay < left ? delay : left);
        delay = delay * 2 < RETRY_MAX_MS ? delay * 2 : RETRY_MAX_MS;
    }
}

int cgpu_relay_call(const char *prog, const char *path, const char *request, size_t len, char *msg, size_t size)
{
    return call(prog, path, request, len, msg, size, 0);
}

int cgpu_relay_finish(const char *prog, int fd, const char *path, const char *request, size_t len, char *msg,
                      size_t size)
{
    struct timeval tv = {.tv_sec = CGPU_RELAY_TIMEOUT_S};
    int gone = 0, rc;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0)
        rc = fail(msg, size, "cannot wait for cgpud's answer on %s: %s", path, strerror(errno));
    else
        rc = read_answer(fd, path, 0, msg, size, &gone);
    close(fd);
    /* Gone before answering (a restart): asked again, as any request is. */
    return gone ? call(prog, path, request, len, msg, size, 1) : rc;
}

int cgpu_relay_send_fd(const char *path, const char *request, size_t len, int pass_fd, char *msg, size_t size,
                      int *down)
{
    struct sockaddr_un addr;
    *down = 0;
    if (len == 0)
        return fail(msg, size, "an empty request cannot carry a descriptor");
    if (relay_address(&addr, path, len, msg, size) < 0)
        return -1;
    int fd = connect_relay(&addr, path, msg, size, down);
    if (fd < 0)
        return -1;
    /* The descriptor rides on the first byte; the rest follows as usual. */
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof(control));
    struct iovec iov = {.iov_base = (void *)request, .iov_len = 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    ssize_t n;
    do
        n = sendmsg(fd, &m, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n != 1 || send_all(fd, request + 1, len - 1) < 0 || shutdown(fd, SHUT_WR) < 0) {
        int err = errno;
        close(fd);
        return fail(msg, size, "cannot send to cgpud at %s: %s", path, strerror(err));
    }
    return fd;
}

int cgpu_relay_answer(int fd, const char *path, char *msg, size_t size, int *gone)
{
    int rc = read_answer(fd, path, 0, msg, size, gone);
    close(fd);
    return rc;
}

void cgpu_relay_report(const char *prog, const char *msg)
{
    fprintf(stderr, "%s: %s\n", prog, msg);
}
