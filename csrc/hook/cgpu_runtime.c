/* cgpu-runtime-gpu: the OCI runtime shim proper. containerd and docker call
 * cgpu-runtime (runtime_front.c) instead of runc; it execs the real runtime
 * itself unless a command needs this program: `create` or `run` of a bundle
 * that may ask for a GPU share, `--version`, or a real runtime it could not
 * run (the message is written here). Every command goes to the real runtime
 * unchanged; before `create` or `run` of a bundle that may ask for a GPU
 * share, cgpud prepares the bundle, and unless it answers ok the container
 * does not start. Messages still say cgpu-runtime: that is what users run.
 *
 * `create --pid-file` of a GPU container (what containerd and docker run):
 * the shim binds the instance to the init pid itself once the real create
 * succeeded, so runc runs no hook of ours (a hook is a fork+exec of
 * cgpu-hook by runc at each stage). `run`, and `create` without --pid-file,
 * keep the OCI hook. Nothing is released at `delete`, which is a plain exec
 * of the real runtime: cgpud watches the init it bound and releases the
 * instance when it exits. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "relay.h"
#include "runtime_rules.h"

#define PROG "cgpu-runtime"
#define ID_MAX CGPU_CONTAINER_ID_MAX
#define INSTANCE_MAX 63

static struct runc_globals g_opts;

/* A GPU container the shim binds and releases itself. */
struct shim_bound {
    char instance[INSTANCE_MAX + 1];
    char bundle[PATH_MAX];
    const char *id;
    const char *pid_file;
};

static const char *env_or(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

static size_t json_escape(char *dst, size_t size, const char *src)
{
    size_t o = 0;
    for (; *src; src++) {
        unsigned char c = (unsigned char)*src;
        char tmp[8];
        if (c == '"' || c == '\\')
            snprintf(tmp, sizeof(tmp), "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            snprintf(tmp, sizeof(tmp), "\\u%04x", c);
        else
            snprintf(tmp, sizeof(tmp), "%c", c);
        size_t n = strlen(tmp);
        if (o + n >= size)
            break;
        memcpy(dst + o, tmp, n);
        o += n;
    }
    dst[o] = '\0';
    return o;
}

/* containerd shows the user the last error entry of runc's --log file, not
 * our stderr, so the reason has to be there too, in runc's format. */
static void log_error(const char *msg)
{
    if (!g_opts.log || !*g_opts.log)
        return;
    char when[32] = "1970-01-01T00:00:00Z";
    struct tm tm;
    time_t now = time(NULL);
    if (gmtime_r(&now, &tm))
        strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    char text[CGPU_RELAY_MSG_MAX + 512];
    snprintf(text, sizeof(text), PROG ": %s", msg);
    char escaped[sizeof(text) * 6];
    json_escape(escaped, sizeof(escaped), text);
    char line[sizeof(escaped) + 128];
    int n;
    if (g_opts.log_format && strcmp(g_opts.log_format, "json") == 0)
        n = snprintf(line, sizeof(line), "{\"level\":\"error\",\"msg\":\"%s\",\"time\":\"%s\"}\n", escaped, when);
    else
        n = snprintf(line, sizeof(line), "time=\"%s\" level=error msg=\"%s\"\n", when, escaped);
    int fd = open(g_opts.log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    /* One write, so the line lands whole among runc's own appends. A failure
     * has nowhere left to go: stderr already has the message. */
    ssize_t written = write(fd, line, (size_t)n);
    (void)written;
    close(fd);
}

__attribute__((format(printf, 2, 3))) static _Noreturn void die(int code, const char *fmt, ...)
{
    char msg[CGPU_RELAY_MSG_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    cgpu_relay_report(PROG, msg);
    log_error(msg);
    exit(code);
}

static _Noreturn void run_real_runtime(const char *runtime, char **argv)
{
    argv[0] = (char *)runtime;
    execvp(runtime, argv);
    /* Fails closed: a GPU container must not start without its limits. */
    die(127, "cannot run %s: %s (install runc or set CGPU_REAL_RUNTIME)", runtime, strerror(errno));
}

/* Index of the command in argv (of its NULL end if none); fills g_opts. */
static int parse_globals(char **argv)
{
    return runc_globals(argv, &g_opts);
}

static long read_or_errno(int fd, char *buf, size_t n)
{
    ssize_t got = read(fd, buf, n);
    return got < 0 ? -errno : got;
}
_Static_assert(EINTR == RR_EINTR, "runtime_rules.h retries reads on RR_EINTR");

/* Decides from the raw bytes, without parsing JSON: this runs before every
 * container start on the node, most of which ask for no GPU. */
static enum config_kind read_config(const char *bundle)
{
    static char buf[CONFIG_BUF];
    char path[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/config.json", bundle) >= (int)sizeof(path))
        return CONFIG_UNREADABLE;
    /* O_NONBLOCK: opening a FIFO must not hang the start path. */
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return CONFIG_UNREADABLE;
    struct stat st;
    enum config_kind kind = CONFIG_UNREADABLE;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))
        goto out;
    /* Too big to scan cheaply: let cgpud decide rather than risk a GPU
     * container starting without its limits. */
    kind = CONFIG_MAY_ASK;
    if (st.st_size > CONFIG_MAX)
        goto out;
    kind = scan_config_reads(fd, buf, read_or_errno);
out:
    close(fd);
    return kind;
}

/* The socket on which the front sent this start's prepare request
 * (runtime_front.c), or -1: then the shim sends it. Taken only if it is a
 * connection to `socket` (a variable from elsewhere names no such thing). */
static int sent_prepare(const char *socket)
{
    const char *v = getenv(SENT_FD_ENV);
    if (!v)
        return -1;
    char *end;
    errno = 0;
    long fd = strtol(v, &end, 10);
    int bad = errno || end == v || *end || fd < 3 || fd > INT_MAX;
    unsetenv(SENT_FD_ENV); /* not the real runtime's */
    struct stat st;
    struct sockaddr_un peer;
    socklen_t len = sizeof(peer);
    if (bad || fstat((int)fd, &st) < 0 || !S_ISSOCK(st.st_mode) ||
        getpeername((int)fd, (struct sockaddr *)&peer, &len) < 0 || peer.sun_family != AF_UNIX ||
        len < offsetof(struct sockaddr_un, sun_path))
        return -1;
    /* The address cgpud bound: its socket path, which may fill sun_path without a NUL. */
    size_t room = (len < sizeof(peer) ? len : sizeof(peer)) - offsetof(struct sockaddr_un, sun_path);
    size_t n = strnlen(peer.sun_path, room);
    if (n != strlen(socket) || memcmp(peer.sun_path, socket, n) != 0)
        return -1;
    int flags = fcntl((int)fd, F_GETFL);
    if (flags < 0 || fcntl((int)fd, F_SETFL, flags & ~O_NONBLOCK) < 0 || fcntl((int)fd, F_SETFD, FD_CLOEXEC) < 0)
        return -1; /* the front opened it without waiting; the answer is waited for */
    return (int)fd;
}

/* The value of --pid-file among create's arguments, or NULL. */
static const char *create_pid_file(char **args)
{
    const char *bundle = ".", *id = NULL, *pid_file = NULL;
    parse_create(args, &bundle, &id, &pid_file);
    return pid_file;
}

/* Returns only if the real runtime should run. With `bound` (create with
 * --pid-file), cgpud writes no hooks and bound->instance names the instance
 * the shim must bind ("" when the bundle asks for no GPU). */
static void prepare(const char *command, char **args, const char *socket, struct shim_bound *bound)
{
    const char *bundle = ".", *id = NULL;
    parse_create(args, &bundle, &id, NULL);
    /* Sent by the front: cgpud has been working on it while this program
     * started, and decides whether the bundle asks for anything. */
    int sent = sent_prepare(socket);
    char bundle_abs[PATH_MAX];
    if (!realpath(bundle, bundle_abs)) {
        if (sent < 0)
            return; /* the runtime's error to report */
        die(1, "cannot resolve bundle %s: %s", bundle, strerror(errno)); /* it did a moment ago */
    }
    if (sent < 0 && read_config(bundle_abs) != CONFIG_MAY_ASK)
        return;
    if (!id)
        die(1, "container id missing: usage is %s [options] <container-id>", command);
    if (!valid_container_id(id))
        die(1, "container id is not valid: expected 1-%d printable ASCII characters without spaces", ID_MAX);
    static char request[ID_MAX + PATH_MAX + 32];
    long len = prepare_request(request, sizeof(request), id, bundle_abs, bound != NULL);
    if (len < 0)
        die(1, "container id and bundle path too long for a prepare request");
    char msg[CGPU_RELAY_MSG_MAX];
    int rc = sent >= 0 ? cgpu_relay_finish(PROG, sent, socket, request, (size_t)len, msg, sizeof(msg))
                       : cgpu_relay_call(PROG, socket, request, (size_t)len, msg, sizeof(msg));
    if (rc != 0)
        die(1, "%s", msg);
    if (!bound || strncmp(msg, "instance ", 9) != 0)
        return;
    const char *inst = msg + 9;
    size_t n = strlen(inst);
    if (n == 0 || n > INSTANCE_MAX || strspn(inst, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") != n)
        die(1, "cgpud named an instance the shim cannot use: %.80s", inst);
    memcpy(bound->instance, inst, n + 1);
    memcpy(bound->bundle, bundle_abs, sizeof(bound->bundle));
    bound->id = id;
}

/* ---- the shim's own bind and release ----------------------------------------------- */

/* The OCI state the createRuntime/poststop hooks would get, as far as
 * cgpud reads it: id, bundle, pid. */
static int bound_request(char *buf, size_t size, const char *verb, const struct shim_bound *b, long pid)
{
    static char id[ID_MAX * 6 + 1], bundle[PATH_MAX * 6 + 1];
    json_escape(id, sizeof(id), b->id);
    json_escape(bundle, sizeof(bundle), b->bundle);
    int n = snprintf(buf, size, "%s %s\n{\"ociVersion\":\"1.0.2\",\"id\":\"%s\",\"bundle\":\"%s\"", verb, b->instance, id,
                     bundle);
    if (n > 0 && (size_t)n < size && pid > 0)
        n += snprintf(buf + n, size - (size_t)n, ",\"status\":\"created\",\"pid\":%ld", pid);
    if (n > 0 && (size_t)n < size)
        n += snprintf(buf + n, size - (size_t)n, "}");
    return n > 0 && (size_t)n < size ? n : -1;
}

static int relay_bound(const char *socket, const char *verb, const struct shim_bound *b, long pid, char *msg,
                       size_t size)
{
    static char request[ID_MAX * 6 + PATH_MAX * 6 + 256];
    int n = bound_request(request, sizeof(request), verb, b, pid);
    if (n < 0) {
        snprintf(msg, size, "container id and bundle too long for a %s request", verb);
        return -1;
    }
    return cgpu_relay_call(PROG, socket, request, (size_t)n, msg, size);
}

/* The init pid runc wrote: a decimal number > 1, from a regular file. */
static long read_pid_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return -1;
    struct stat st;
    char buf[32];
    ssize_t n = -1;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
        n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *end;
    errno = 0;
    long pid = strtol(buf, &end, 10);
    if (errno || end == buf || (*end && *end != '\n') || pid <= 1 || buf[0] == '-' || buf[0] == '+')
        return -1;
    return pid;
}

/* Runs the real runtime and waits; returns its exit code (128+signal). A
 * shim killed meanwhile takes the runtime with it, as when it exec'd it.
 * vfork: nothing to copy on the start path; the child only makes system
 * calls until it execs or exits. */
static int spawn_runtime(const char *runtime, char **argv)
{
    static const char cannot[] = PROG ": cannot run the real runtime (install runc or set CGPU_REAL_RUNTIME)\n";
    pid_t parent = getpid();
    argv[0] = (char *)runtime;
    pid_t child = vfork();
    if (child < 0)
        die(127, "cannot run %s: fork: %s", runtime, strerror(errno));
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        execvp(runtime, argv);
        ssize_t said = write(2, cannot, sizeof(cannot) - 1);
        (void)said;
        _exit(127);
    }
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR)
            die(127, "cannot wait for %s: %s", runtime, strerror(errno));
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* `<globals> delete --force <id>`: undoes a create whose bind failed. */
static void force_delete(const char *runtime, char **argv, int cmd, const char *id)
{
    static char *args[256];
    if (cmd + 4 > (int)(sizeof(args) / sizeof(args[0])))
        return;
    for (int i = 0; i < cmd; i++)
        args[i] = argv[i];
    args[cmd] = "delete";
    args[cmd + 1] = "--force";
    args[cmd + 2] = (char *)id;
    args[cmd + 3] = NULL;
    spawn_runtime(runtime, args);
}

static _Noreturn void create_and_bind(const char *runtime, char **argv, int cmd, const char *socket,
                                      const struct shim_bound *b)
{
    char msg[CGPU_RELAY_MSG_MAX], ignored[CGPU_RELAY_MSG_MAX];
    int code = spawn_runtime(runtime, argv);
    if (code != 0) {
        /* runc said why; the instance made for this start goes. */
        relay_bound(socket, "release", b, 0, ignored, sizeof(ignored));
        exit(code);
    }
    long pid = read_pid_file(b->pid_file);
    int bound = pid > 1 ? relay_bound(socket, "bind", b, pid, msg, sizeof(msg)) : -1;
    if (pid <= 1)
        snprintf(msg, sizeof(msg), "cannot read the init pid of container %s from %s", b->id, b->pid_file);
    if (bound == 0)
        exit(0);
    force_delete(runtime, argv, cmd, b->id);
    relay_bound(socket, "release", b, 0, ignored, sizeof(ignored));
    die(1, "%s", msg);
}

int main(int argc, char **argv)
{
    if (argc < 1)
        return 2;
    const char *runtime = env_or("CGPU_REAL_RUNTIME", "runc");
    const char *socket = env_or("CGPU_RELAY_SOCKET", CGPU_RELAY_DEFAULT_SOCKET);
    int cmd = parse_globals(argv);
    const char *pid_file;
    if (g_opts.version) {
        printf(PROG " " CGPU_VERSION "\n");
        fflush(stdout);
    } else if (argv[cmd] && strcmp(argv[cmd], "create") == 0 && (pid_file = create_pid_file(argv + cmd + 1))) {
        struct shim_bound b = {.pid_file = pid_file};
        prepare(argv[cmd], argv + cmd + 1, socket, &b);
        if (b.instance[0])
            create_and_bind(runtime, argv, cmd, socket, &b);
    } else if (argv[cmd] && (strcmp(argv[cmd], "create") == 0 || strcmp(argv[cmd], "run") == 0)) {
        prepare(argv[cmd], argv + cmd + 1, socket, NULL);
    }
    run_real_runtime(runtime, argv);
}
