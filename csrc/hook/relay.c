/* The relay client: how cgpu-runtime and cgpu-hook ask cgpud. */
#define _GNU_SOURCE
#include "relay.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

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

/* After a failed send cgpud may still have answered (e.g. it rejected the
 * request early and closed), so the answer is read either way. */
static int exchange(int fd, const char *path, const char *request, size_t len, char *msg, size_t size)
{
    int send_err = 0;
    if (send_all(fd, request, len) < 0 || shutdown(fd, SHUT_WR) < 0)
        send_err = errno;
    if (send_err == EAGAIN)
        return timed_out(path, msg, size);

    char line[CGPU_RELAY_MSG_MAX];
    size_t n = 0;
    const char *nl = NULL;
    while (!nl && n < sizeof(line)) {
        ssize_t r = recv(fd, line + n, sizeof(line) - n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EAGAIN)
            return timed_out(path, msg, size);
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
    if (send_err)
        return fail(msg, size, "lost the connection to cgpud at %s: %s", path, strerror(send_err));
    if (n == 0)
        return fail(msg, size, "cgpud sent no answer on %s", path);
    if (n == sizeof(line))
        return fail(msg, size, "cgpud sent an answer longer than %zu bytes on %s", sizeof(line), path);
    return fail(msg, size, "cgpud sent an incomplete answer on %s", path);
}

int cgpu_relay_call(const char *path, const char *request, size_t len, char *msg, size_t size)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    size_t path_len = strlen(path);
    if (len > CGPU_RELAY_MAX_REQUEST)
        return fail(msg, size, "request of %zu bytes is larger than the %d cgpud accepts", len,
                    CGPU_RELAY_MAX_REQUEST);
    if (path_len >= sizeof(addr.sun_path))
        return fail(msg, size, "cannot reach cgpud at %s: socket path longer than %zu bytes", path,
                    sizeof(addr.sun_path) - 1);
    memcpy(addr.sun_path, path, path_len + 1);

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
    if (connect(fd, (const struct sockaddr *)&addr, sizeof(addr)) < 0) {
        int err = errno;
        close(fd);
        if (err == EAGAIN)
            return timed_out(path, msg, size);
        return fail(msg, size, "cannot reach cgpud at %s: %s (is cgpud running?)", path, strerror(err));
    }
    int rc = exchange(fd, path, request, len, msg, size);
    close(fd);
    return rc;
}

void cgpu_relay_report(const char *prog, const char *msg)
{
    fprintf(stderr, "%s: %s\n", prog, msg);
}
