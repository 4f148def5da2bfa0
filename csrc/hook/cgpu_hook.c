/* cgpu-hook: the OCI hook relay. runc runs it with the container state on
 * stdin; it hands the state to cgpud and fails the container's start if cgpud
 * says no. The hook entry cgpud writes names the stage and the instance, so
 * nothing here depends on the environment (but CGPU_RELAY_WAIT_MS, which
 * can only shorten the wait), the cwd or the container rootfs.
 *
 * Built without libc on x86-64 and aarch64 (mini_sys.h), as the front is:
 * runc runs it inside every CDI/hooks start's `create`, where a glibc
 * program's start-up cost about 0.4 ms of the 0.55 its exec took here. So
 * it carries its own client of the relay protocol (cgpu/relay_wire.h), the
 * same requests, answers, bounds, waits and messages as relay.c, which the
 * glibc shim uses. Nothing is allocated; one thread. */
#if !defined(CGPU_FRONT_FREESTANDING)
#define _GNU_SOURCE
#include <stdlib.h> /* exit: the fuzz harness takes it back (tests/fuzz) */
#include <unistd.h> /* environ */
#endif
#include <stddef.h>

#include "cgpu/region.h"
#include "cgpu/relay_wire.h"
#include "mini_sys.h"

#ifndef CGPU_VERSION
#error "CGPU_VERSION is not defined: build the relays with csrc/build_native.py"
#endif

#define PROG "cgpu-hook"
#define USAGE "usage: cgpu-hook [--socket PATH] --instance ID STAGE"
#define INSTANCE_MAX (CGPU_INSTANCE_ID_LEN - 1) /* the longest id a region holds */
#define STAGE_MAX 64
#define RETRY_FIRST_MS 50
#define RETRY_MAX_MS 500
#define START_HINT "start it (systemctl start cgpud)"

#if defined(CGPU_FRONT_FREESTANDING)
#define hook_exit f_exit
#else
#define hook_exit exit
#endif

/* ---- text ------------------------------------------------------------------------------ */

static size_t h_strlen(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

static int h_streq(const char *a, const char *b)
{
    size_t i = 0;
    for (; a[i] && a[i] == b[i]; i++)
        ;
    return a[i] == b[i];
}

/* A message being built in a caller's buffer: always NUL-terminated, cut
 * at its size as snprintf cuts. */
struct text {
    char *p;
    size_t size, n;
};

static struct text text_in(char *p, size_t size)
{
    p[0] = '\0';
    return (struct text){p, size, 0};
}

static void put_n(struct text *t, const char *s, size_t n)
{
    for (size_t i = 0; i < n && t->n + 1 < t->size; i++)
        t->p[t->n++] = s[i];
    t->p[t->n] = '\0';
}

static void put(struct text *t, const char *s)
{
    put_n(t, s, h_strlen(s));
}

static void put_dec(struct text *t, unsigned long v)
{
    char tmp[24];
    size_t n = 0;
    do
        tmp[n++] = (char)('0' + v % 10);
    while ((v /= 10) != 0);
    for (; n > 0; n--)
        put_n(t, &tmp[n - 1], 1);
}

static void put_err(struct text *t, int err)
{
    const char *s = f_strerror(err);
    if (s) {
        put(t, s);
        return;
    }
    put(t, "Unknown error ");
    put_dec(t, (unsigned long)err);
}

/* ms / 1000 seconds as printf's "%.3g" writes them, for 0 <= ms <= 99999
 * (the wait is at most CGPU_RELAY_WAIT_S): three significant digits,
 * rounded half up, trailing zeros dropped. */
static void put_seconds(struct text *t, long ms)
{
    unsigned long u = (unsigned long)ms, scale = 1000; /* u / scale seconds */
    if (ms >= 10000) {
        u = (u + 50) / 100;
        scale = 10;
    } else if (ms >= 1000) {
        u = (u + 5) / 10;
        scale = 100;
    }
    put_dec(t, u / scale);
    char frac[4];
    size_t k = 0;
    for (unsigned long s = scale / 10; s > 0; s /= 10)
        frac[k++] = (char)('0' + (u % scale) / s % 10);
    while (k > 0 && frac[k - 1] == '0')
        k--;
    if (k > 0) {
        put(t, ".");
        put_n(t, frac, k);
    }
}

/* The answer ends up on a terminal and in runc's log: one line, no escapes. */
static void put_printable(struct text *t, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)src[i];
        char out = (c < 0x20 || c == 0x7f) ? ' ' : (char)c;
        put_n(t, &out, 1);
    }
}

/* "<prog>: <line>" on stderr, in one write. */
static void report(const char *line, const char *tail)
{
    static char out[CGPU_RELAY_MSG_MAX + 128];
    struct text t = text_in(out, sizeof(out) - 1);
    put(&t, PROG ": ");
    put(&t, line);
    put(&t, tail);
    out[t.n++] = '\n';
    f_write(2, out, t.n);
}

/* ---- the relay client (relay.c's, without libc) ---------------------------------------- */

struct relay_addr {
    unsigned short family; /* struct sockaddr_un */
    char path[108];
};

static int timed_out(struct text *msg, const char *path)
{
    put(msg, "cgpud did not answer within ");
    put_dec(msg, CGPU_RELAY_TIMEOUT_S);
    put(msg, " s on ");
    put(msg, path);
    return -1;
}

static int cannot_reach(struct text *msg, const char *path, int err)
{
    put(msg, "cannot reach cgpud at ");
    put(msg, path);
    put(msg, ": ");
    put_err(msg, err);
    return -1;
}

static int went_away(struct text *msg, const char *path, int err, int *gone)
{
    *gone = 1;
    put(msg, "cgpud went away without answering (");
    put(msg, path);
    put(msg, ": ");
    if (err)
        put_err(msg, err);
    else
        put(msg, "connection closed");
    put(msg, ")");
    return -1;
}

static int lost(struct text *msg, const char *path, int err)
{
    put(msg, "lost the connection to cgpud at ");
    put(msg, path);
    put(msg, ": ");
    put_err(msg, err);
    return -1;
}

static int starts_with(const char *line, size_t len, const char *word)
{
    size_t n = h_strlen(word);
    if (len < n)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (line[i] != word[i])
            return 0;
    return 1;
}

static int parse_answer(const char *line, size_t len, const char *path, struct text *msg)
{
    if (len == 2 && starts_with(line, len, "ok"))
        return 0;
    if (starts_with(line, len, "ok ")) {
        put_printable(msg, line + 3, len - 3);
        return 0;
    }
    if (len > 6 && starts_with(line, len, "error ")) {
        put_printable(msg, line + 6, len - 6);
        return -1;
    }
    if (len == 5 ? starts_with(line, len, "error") : len == 6 && starts_with(line, len, "error ")) {
        put(msg, "cgpud refused without giving a reason (on ");
        put(msg, path);
        put(msg, ")");
        return -1;
    }
    put(msg, "cgpud sent an unexpected answer on ");
    put(msg, path);
    put(msg, ": ");
    put_printable(msg, line, len < 80 ? len : 80);
    return -1;
}

/* The answer to a request sent on fd; send_err: the errno of a failed
 * send, or 0. *gone: cgpud closed or reset the connection without a byte
 * of answer, as a daemon that dies or restarts mid-request does. */
static int read_answer(int fd, const char *path, int send_err, struct text *msg, int *gone)
{
    *gone = 0;
    char line[CGPU_RELAY_MSG_MAX];
    size_t n = 0;
    int newline = 0;
    while (!newline && n < sizeof(line)) {
        long r = f_recv(fd, line + n, sizeof(line) - n);
        if (r == -E_INTR)
            continue;
        if (r == -E_AGAIN)
            return timed_out(msg, path);
        if (r == -E_CONNRESET && n == 0)
            return went_away(msg, path, E_CONNRESET, gone);
        if (r < 0)
            return lost(msg, path, send_err ? send_err : (int)-r);
        if (r == 0)
            break;
        for (size_t i = n; i < n + (size_t)r; i++)
            if (line[i] == '\n') {
                newline = 1;
                n = i;
                break;
            }
        if (!newline)
            n += (size_t)r;
    }
    if (newline)
        return parse_answer(line, n, path, msg);
    if (n == 0 && (send_err == 0 || send_err == E_PIPE || send_err == E_CONNRESET))
        return went_away(msg, path, send_err, gone);
    if (send_err)
        return lost(msg, path, send_err);
    if (n == sizeof(line)) {
        put(msg, "cgpud sent an answer longer than ");
        put_dec(msg, sizeof(line));
        put(msg, " bytes on ");
        put(msg, path);
        return -1;
    }
    put(msg, "cgpud sent an incomplete answer on ");
    put(msg, path);
    return -1;
}

/* A connection to cgpud with every step bounded, or -1 (msg says why;
 * *down set when cgpud is not there: socket missing or refusing). */
static int connect_relay(const struct relay_addr *addr, const char *path, struct text *msg, int *down)
{
    *down = 0;
    int fd = f_unix_socket_blocking();
    if (fd < 0)
        return cannot_reach(msg, path, -fd);
    /* Bounds every step, connect included: a wedged daemon must not hang
     * container creation forever. */
    int err = -f_socket_timeout(fd, F_SO_RCVTIMEO, CGPU_RELAY_TIMEOUT_S);
    if (!err)
        err = -f_socket_timeout(fd, F_SO_SNDTIMEO, CGPU_RELAY_TIMEOUT_S);
    if (!err)
        err = -f_connect(fd, addr, sizeof(*addr));
    if (!err)
        return fd;
    f_close(fd);
    if (err == E_AGAIN)
        return timed_out(msg, path);
    /* ENOENT: cgpud stopped and removed its socket; ECONNREFUSED: it died
     * and left the socket behind. Anything else (EACCES, ...) is not cured
     * by waiting. */
    if (err == E_NOENT || err == E_CONNREFUSED) {
        *down = 1;
        put(msg, "cgpud is not running (");
        put(msg, path);
        put(msg, ": ");
        put_err(msg, err);
        put(msg, ")");
        return -1;
    }
    return cannot_reach(msg, path, err);
}

/* One connection, one request. After a failed send cgpud may still have
 * answered (e.g. it rejected the request early and closed), so the answer
 * is read either way. *down: cgpud was not there to ask, or went away
 * before answering; every request is safe to send again (the hooks are
 * idempotent for the same container and instance; docs/containers.md). */
static int attempt(const struct relay_addr *addr, const char *path, const char *request, size_t len,
                   struct text *msg, int *down)
{
    int fd = connect_relay(addr, path, msg, down);
    if (fd < 0)
        return -1;
    int send_err = 0;
    for (size_t done = 0; done < len;) {
        long n = f_send(fd, request + done, len - done); /* MSG_NOSIGNAL: a hang-up is an error */
        if (n == -E_INTR)
            continue;
        if (n < 0) {
            send_err = (int)-n;
            break;
        }
        done += (size_t)n;
    }
    if (!send_err)
        send_err = -f_shutdown_write(fd);
    int rc;
    if (send_err == E_AGAIN) {
        *down = 0;
        rc = timed_out(msg, path);
    } else {
        rc = read_answer(fd, path, send_err, msg, down);
    }
    f_close(fd);
    return rc;
}

static const char *env_value(char *const *envp, const char *name)
{
    for (; envp && *envp; envp++) {
        const char *e = *envp;
        size_t i = 0;
        while (name[i] && e[i] == name[i])
            i++;
        if (!name[i] && e[i] == '=')
            return e + i + 1;
    }
    return NULL;
}

/* The wait bound: CGPU_RELAY_WAIT_S, or less if CGPU_RELAY_WAIT_MS says so
 * (0: fail at once), read as strtol reads it. Never more: a longer wait
 * would outlast the timeouts of runc and containerd, whose own message
 * then says less than ours. */
static long wait_budget_ms(char *const *envp)
{
    const long most = CGPU_RELAY_WAIT_S * 1000L;
    const char *v = env_value(envp, "CGPU_RELAY_WAIT_MS");
    if (!v || !*v)
        return most;
    while (*v == ' ' || (*v >= '\t' && *v <= '\r'))
        v++;
    int negative = *v == '-';
    if (*v == '-' || *v == '+')
        v++;
    long ms = 0;
    const char *digits = v;
    for (; *v >= '0' && *v <= '9'; v++) {
        if (ms > most) /* already past the bound: the rest cannot bring it back */
            ms = most + 1;
        else
            ms = ms * 10 + (*v - '0');
    }
    if (v == digits || *v || (negative && ms != 0))
        return most;
    return ms < most ? ms : most;
}

static int relay_call(const char *path, const char *request, size_t len, struct text *msg, char *const *envp)
{
    struct relay_addr addr = {.family = F_AF_UNIX};
    size_t path_len = h_strlen(path);
    if (path_len >= sizeof(addr.path)) {
        put(msg, "cannot reach cgpud at ");
        put(msg, path);
        put(msg, ": socket path longer than ");
        put_dec(msg, sizeof(addr.path) - 1);
        put(msg, " bytes");
        return -1;
    }
    memcpy(addr.path, path, path_len + 1);

    const long budget = wait_budget_ms(envp), deadline = f_now_ms() + budget;
    long delay = RETRY_FIRST_MS;
    for (int tries = 0;; tries++) {
        int down = 0;
        *msg = text_in(msg->p, msg->size);
        int rc = attempt(&addr, path, request, len, msg, &down);
        if (!down)
            return rc;
        long left = deadline - f_now_ms();
        if (left <= 0) {
            char why[CGPU_RELAY_MSG_MAX];
            struct text w = text_in(why, sizeof(why));
            put(&w, msg->p);
            *msg = text_in(msg->p, msg->size);
            put(msg, why);
            if (tries == 0) {
                put(msg, ": " START_HINT);
            } else {
                put(msg, "; it did not come back within ");
                put_seconds(msg, budget);
                put(msg, " s: " START_HINT);
            }
            return -1;
        }
        /* One line, once: the start is slow on purpose, not hung. */
        if (tries == 0) {
            char tail[64];
            struct text t = text_in(tail, sizeof(tail));
            put(&t, "; retrying for ");
            put_seconds(&t, budget);
            put(&t, " s");
            report(msg->p, tail);
        }
        f_sleep_ms(delay < left ? delay : left);
        delay = delay * 2 < RETRY_MAX_MS ? delay * 2 : RETRY_MAX_MS;
    }
}

/* ---- the hook -------------------------------------------------------------------------- */

static _Noreturn void usage_error(const char *a, const char *b, const char *c, const char *d)
{
    char msg[512]; /* as long as the message it replaces could be */
    struct text t = text_in(msg, sizeof(msg));
    put(&t, a);
    put(&t, b);
    put(&t, c);
    put(&t, d);
    report(msg, "\n" USAGE);
    hook_exit(2);
}

static int is_alpha(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

static int valid_stage(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!is_alpha(s[n]))
            return 0;
    return n > 0 && n <= STAGE_MAX;
}

static int valid_instance(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!is_alpha(s[n]) && !(s[n] >= '0' && s[n] <= '9') && s[n] != '_' && s[n] != '.' && s[n] != '-')
            return 0;
    return n > 0 && n <= INSTANCE_MAX;
}

/* Matches "--name VALUE" and "--name=VALUE"; advances *i past the value. */
static int option(char **argv, int argc, int *i, const char *name, const char **value)
{
    const char *a = argv[*i];
    size_t n = h_strlen(name);
    for (size_t k = 0; k < n; k++)
        if (a[k] != name[k])
            return 0;
    if (a[n] != '\0' && a[n] != '=')
        return 0;
    if (a[n] == '=')
        *value = a + n + 1;
    else if (*i + 1 < argc)
        *value = argv[++*i];
    else
        usage_error(name, " needs a value", "", "");
    return 1;
}

#define STR_(x) #x
#define STR(x) STR_(x)
/* INSTANCE_MAX written out, for a message made without printf. */
#define CGPU_INSTANCE_ID_DIGITS 63
_Static_assert(CGPU_INSTANCE_ID_DIGITS == INSTANCE_MAX, "the usage message names the longest instance id");

static int hook_main(int argc, char **argv, char *const *envp)
{
    /* The request is built in place: the state is read straight after its line. */
    static char request[CGPU_RELAY_MAX_REQUEST + 1];
    const char *socket = CGPU_RELAY_DEFAULT_SOCKET, *instance = NULL;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (h_streq(argv[i], "--version")) {
            f_write(1, PROG " " CGPU_VERSION "\n", sizeof(PROG " " CGPU_VERSION "\n") - 1);
            return 0;
        }
        if (!option(argv, argc, &i, "--socket", &socket) && !option(argv, argc, &i, "--instance", &instance))
            usage_error("unknown option ", argv[i], "", "");
    }
    if (i == argc)
        usage_error("missing STAGE (the OCI hook stage, e.g. createRuntime)", "", "", "");
    if (i + 1 < argc)
        usage_error("unexpected argument ", argv[i + 1], " after STAGE ", argv[i]);
    const char *stage = argv[i];
    if (!valid_stage(stage))
        usage_error("STAGE must be 1-" STR(STAGE_MAX) " letters, got \"", stage, "\"", "");
    if (!instance)
        usage_error("missing --instance ID (the hook entry must name its cgpu instance)", "", "", "");
    if (!valid_instance(instance))
        usage_error("--instance must be 1-" STR(CGPU_INSTANCE_ID_DIGITS) " characters of A-Z a-z 0-9 _ . -, got \"",
                    instance, "\"", "");
    if (socket[0] != '/')
        usage_error("--socket must be an absolute path, got \"", socket, "\"", "");

    struct text req = text_in(request, sizeof(request));
    put(&req, "hook ");
    put(&req, stage);
    put(&req, " ");
    put(&req, instance);
    put(&req, "\n");
    size_t head = req.n, cap = CGPU_RELAY_MAX_REQUEST - head, n = 0;
    char *state = request + head;
    char msg_buf[CGPU_RELAY_MSG_MAX];
    struct text msg = text_in(msg_buf, sizeof(msg_buf));
    while (n <= cap) {
        long r = f_read(0, state + n, cap + 1 - n);
        if (r == -E_INTR)
            continue;
        if (r < 0) {
            put(&msg, "cannot read the container state from stdin: ");
            put_err(&msg, (int)-r);
            report(msg.p, "");
            return 1;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    size_t lead = 0;
    while (lead < n && (state[lead] == ' ' || state[lead] == '\t' || state[lead] == '\r' || state[lead] == '\n'))
        lead++;
    if (lead >= n || state[lead] != '{') {
        report("expected the OCI container state (a JSON object) on stdin", "");
        return 1;
    }
    if (n > cap) {
        put(&msg, "container state larger than ");
        put_dec(&msg, cap);
        put(&msg, " bytes");
        report(msg.p, "");
        return 1;
    }
    if (relay_call(socket, request, head + n, &msg, envp) != 0) {
        report(msg.p, "");
        return 1;
    }
    return 0;
}

#if defined(CGPU_FRONT_FREESTANDING)
__attribute__((used)) _Noreturn void cgpu_hook_start(long *sp);
__attribute__((used)) _Noreturn void cgpu_hook_start(long *sp)
{
    int argc = (int)sp[0];
    char **argv = (char **)(sp + 1);
    f_exit(hook_main(argc, argv, argv + argc + 1));
}

#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %ebp, %ebp\n mov %rsp, %rdi\n and $-16, %rsp\n call cgpu_hook_start\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n mov x0, sp\n bl cgpu_hook_start\n");
#endif
#else
int main(int argc, char **argv)
{
    return hook_main(argc, argv, environ);
}
#endif
