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
 * cgpu-hook by runc at each stage). With runc, `create` starts while cgpud
 * prepares the bundle (create_streamed). `run`, and `create` without --pid-file,
 * keep the OCI hook. Nothing is released at `delete`, which is a plain exec
 * of the real runtime: cgpud watches the init it bound and releases the
 * instance when it exits. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/time.h>
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

/* fd, made blocking and closed on exec, if it is a connection to cgpud's
 * relay socket `socket` (the front's, runtime_front.c); else -1. */
static int relay_connection(int fd, const char *socket)
{
    struct stat st;
    struct sockaddr_un peer;
    socklen_t len = sizeof(peer);
    if (fstat(fd, &st) < 0 || !S_ISSOCK(st.st_mode) || getpeername(fd, (struct sockaddr *)&peer, &len) < 0 ||
        peer.sun_family != AF_UNIX || len < offsetof(struct sockaddr_un, sun_path))
        return -1;
    /* The address cgpud bound: its socket path, which may fill sun_path without a NUL. */
    size_t room = (len < sizeof(peer) ? len : sizeof(peer)) - offsetof(struct sockaddr_un, sun_path);
    size_t n = strnlen(peer.sun_path, room);
    if (n != strlen(socket) || memcmp(peer.sun_path, socket, n) != 0)
        return -1;
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
        return -1; /* the front opened it without waiting; the answer is waited for */
    return fd;
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
    return bad ? -1 : relay_connection((int)fd, socket);
}

/* The value of --pid-file among create's arguments, or NULL. */
static const char *create_pid_file(char **args)
{
    const char *bundle = ".", *id = NULL, *pid_file = NULL;
    parse_create(args, &bundle, &id, &pid_file);
    return pid_file;
}

/* Fills `bound` from a prepare's answer "instance <id>" (left empty for
 * any other: the bundle asked for no GPU); -1 if the name is not one. */
static int take_instance(const char *msg, const char *bundle_abs, const char *id, struct shim_bound *bound)
{
    if (strncmp(msg, "instance ", 9) != 0)
        return 0;
    const char *inst = msg + 9;
    size_t n = strlen(inst);
    if (n == 0 || n > INSTANCE_MAX || strspn(inst, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") != n)
        return -1;
    memcpy(bound->instance, inst, n + 1);
    memcpy(bound->bundle, bundle_abs, sizeof(bound->bundle));
    bound->id = id;
    return 0;
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
    long len = prepare_request(request, sizeof(request), id, bundle_abs, bound ? " " CGPU_RELAY_SHIM_BINDS : "");
    if (len < 0)
        die(1, "container id and bundle path too long for a prepare request");
    char msg[CGPU_RELAY_MSG_MAX];
    int rc = sent >= 0 ? cgpu_relay_finish(PROG, sent, socket, request, (size_t)len, msg, sizeof(msg))
                       : cgpu_relay_call(PROG, socket, request, (size_t)len, msg, sizeof(msg));
    if (rc != 0)
        die(1, "%s", msg);
    if (bound && take_instance(msg, bundle_abs, id, bound) < 0)
        die(1, "cgpud named an instance the shim cannot use: %.80s", msg + 9);
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

/* Starts the real runtime; its pid. A shim killed meanwhile takes the
 * runtime with it, as when it exec'd it. vfork: nothing to copy on the
 * start path; the child only makes system calls until it execs or exits. */
static pid_t start_runtime(const char *runtime, char **argv)
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
    return child;
}

/* Its exit code (128+signal). */
static int wait_runtime(const char *runtime, pid_t child)
{
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR)
            die(127, "cannot wait for %s: %s", runtime, strerror(errno));
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int spawn_runtime(const char *runtime, char **argv)
{
    return wait_runtime(runtime, start_runtime(runtime, argv));
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

/* After the real `create` exited with `code`: binds the instance to the
 * init it made, or undoes the start. */
static _Noreturn void bind_created(const char *runtime, char **argv, int cmd, const char *socket,
                                   const struct shim_bound *b, int code)
{
    char msg[CGPU_RELAY_MSG_MAX], ignored[CGPU_RELAY_MSG_MAX];
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

static _Noreturn void create_and_bind(const char *runtime, char **argv, int cmd, const char *socket,
                                      const struct shim_bound *b)
{
    bind_created(runtime, argv, cmd, socket, b, spawn_runtime(runtime, argv));
}

/* ---- create with the spec streamed to runc --------------------------------------------- */

/* runc spends about 2 ms starting (its Go runtime) before it reads
 * config.json, about what cgpud takes to prepare the bundle. So a GPU
 * `create` starts runc at once, with a FIFO at config.json for it to wait
 * on, and cgpud reads the engine's spec through the descriptor sent with
 * the prepare request. cgpud renames the edited spec over the FIFO; the
 * shim then writes the same bytes into the FIFO, so runc gets them whether
 * its open found the FIFO or the file. The shim holds both ends of the
 * FIFO, so runc's open never waits for a writer (wait_streamed says until
 * when). If cgpud refuses or is not there, the FIFO is still in place, runc
 * cannot have read a spec, and is killed; the engine's config.json is put
 * back. runtime_streams_spec() says which runtimes read the spec so. */
struct streamed {
    int dir;      /* the bundle */
    int original; /* its config.json as the engine wrote it */
    int fifo;     /* the FIFO put at config.json, opened read-write */
    struct stat original_st, fifo_st;
    char tmp[64]; /* the name the FIFO, and a restored copy, are made under */
};

static void close_fd(int *fd)
{
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

static void stream_close(struct streamed *s)
{
    close_fd(&s->dir);
    close_fd(&s->original);
    close_fd(&s->fifo);
}

/* The FIFO in place of the bundle's config.json: 0, or -1 with the bundle
 * as it was. */
static int stream_setup(const char *bundle_abs, struct streamed *s)
{
    *s = (struct streamed){.dir = -1, .original = -1, .fifo = -1};
    snprintf(s->tmp, sizeof(s->tmp), ".config.json.cgpu-%ld", (long)getpid());
    s->dir = open(bundle_abs, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (s->dir < 0)
        goto fail;
    s->original = openat(s->dir, "config.json", O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (s->original < 0 || fstat(s->original, &s->original_st) < 0 || !S_ISREG(s->original_st.st_mode))
        goto fail;
    if (mkfifoat(s->dir, s->tmp, 0600) < 0)
        goto fail;
    s->fifo = openat(s->dir, s->tmp, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    /* The engine's mode: cgpud gives the edited spec the mode it finds there. */
    if (s->fifo < 0 || fchmod(s->fifo, s->original_st.st_mode & 07777) < 0 || fstat(s->fifo, &s->fifo_st) < 0 ||
        renameat(s->dir, s->tmp, s->dir, "config.json") < 0) {
        unlinkat(s->dir, s->tmp, 0);
        goto fail;
    }
    return 0;
fail:
    stream_close(s);
    return -1;
}

static int fifo_in_place(const struct streamed *s)
{
    struct stat st;
    return fstatat(s->dir, "config.json", &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == s->fifo_st.st_dev &&
           st.st_ino == s->fifo_st.st_ino;
}

/* Copies `from` (from its start) into `to`; 0, or -1. The FIFO's end is
 * non-blocking: while it is full, runc is reading it, or it opened the
 * file instead and the rest is not needed once it has exited. */
static int copy_spec(int from, int to, pid_t runtime)
{
    static char buf[1 << 16];
    for (off_t off = 0;;) {
        ssize_t n = pread(from, buf, sizeof(buf), off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return (int)n;
        off += n;
        for (ssize_t done = 0; done < n;) {
            ssize_t w = write(to, buf + done, (size_t)(n - done));
            if (w > 0) {
                done += w;
            } else if (w < 0 && errno == EAGAIN && runtime > 0) {
                siginfo_t info = {0};
                if (waitid(P_PID, (id_t)runtime, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == runtime)
                    return 0;
                struct pollfd p = {.fd = to, .events = POLLOUT};
                poll(&p, 1, 1);
            } else if (w < 0 && errno != EINTR) {
                return -1;
            }
        }
    }
}

/* The engine's config.json back at its path if the FIFO is still there; 0,
 * or -1. */
static int stream_restore(struct streamed *s)
{
    if (!fifo_in_place(s))
        return 0;
    int fd = openat(s->dir, s->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    int ok = copy_spec(s->original, fd, 0) == 0 && fchmod(fd, s->original_st.st_mode & 07777) == 0;
    ok = close(fd) == 0 && ok && renameat(s->dir, s->tmp, s->dir, "config.json") == 0;
    if (!ok)
        unlinkat(s->dir, s->tmp, 0);
    return ok ? 0 : -1;
}

/* Undoes the setup when runc has not read a spec: it is killed, the spec
 * put back. */
static void stream_abandon(struct streamed *s, const char *runtime, pid_t child)
{
    if (child > 0) {
        kill(child, SIGKILL);
        wait_runtime(runtime, child);
    }
    if (stream_restore(s) < 0)
        cgpu_relay_report(PROG, "could not put the bundle's config.json back in place of the FIFO");
    stream_close(s);
}

/* Waits for runc; its exit code. The FIFO is closed once runc has taken
 * all of it, so a reader that wants the end of the file gets it; not
 * before: an open of the FIFO still on its way would then wait for a
 * writer forever. Without pidfd_open (Linux < 5.3) it stays open until
 * runc exits, which runc's decoder does not mind. */
static int wait_streamed(const char *runtime, pid_t child, struct streamed *s)
{
    int pidfd = (int)syscall(SYS_pidfd_open, child, 0);
    for (int tick = 1; pidfd >= 0 && s->fifo >= 0; tick = tick < 16 ? tick * 2 : 16) {
        int queued = 0;
        if (ioctl(s->fifo, FIONREAD, &queued) == 0 && queued == 0) {
            close_fd(&s->fifo);
            break;
        }
        struct pollfd p = {.fd = pidfd, .events = POLLIN};
        if (poll(&p, 1, tick) > 0)
            break; /* runc exited */
    }
    if (pidfd >= 0)
        close(pidfd);
    return wait_runtime(runtime, child);
}

static void stream_run(const char *runtime, char **argv, int cmd, const char *socket, struct shim_bound *b,
                       struct streamed *sp, int conn, pid_t child, const char *bundle_abs, const char *id);

/* `create --pid-file` of a bundle that may ask for a GPU share, with the
 * spec streamed. Returns only if that could not be set up, or cgpud was not
 * there to ask: the bundle is as it was, and the caller asks the usual way. */
static void create_streamed(const char *runtime, char **argv, int cmd, const char *socket, struct shim_bound *b)
{
    const char *bundle = ".", *id = NULL;
    parse_create(argv + cmd + 1, &bundle, &id, NULL);
    char bundle_abs[PATH_MAX];
    static char request[ID_MAX + PATH_MAX + 32];
    struct streamed s;
    long len = -1;
    const char *flags = " " CGPU_RELAY_SHIM_BINDS " " CGPU_RELAY_SPEC_FD;
    if (!id || !valid_container_id(id) || !realpath(bundle, bundle_abs) ||
        (len = prepare_request(request, sizeof(request), id, bundle_abs, flags)) < 0 ||
        stream_setup(bundle_abs, &s) < 0)
        return; /* the usual path says what is wrong */
    char msg[CGPU_RELAY_MSG_MAX];
    int down;
    int conn = cgpu_relay_send_fd(socket, request, (size_t)len, s.original, msg, sizeof(msg), &down);
    if (conn < 0) {
        stream_abandon(&s, runtime, 0);
        return;
    }
    stream_run(runtime, argv, cmd, socket, b, &s, conn, start_runtime(runtime, argv), bundle_abs, id);
}

/* The streamed create once the prepare is on its way on `conn` and runc
 * (`child`) waits on the FIFO: cgpud's answer, the spec fed to runc, the
 * bind. Returns only if cgpud went away before editing: the bundle is as it
 * was, runc gone, and the caller asks the usual way. */
static void stream_run(const char *runtime, char **argv, int cmd, const char *socket, struct shim_bound *b,
                       struct streamed *sp, int conn, pid_t child, const char *bundle_abs, const char *id)
{
    struct streamed s = *sp;
    char msg[CGPU_RELAY_MSG_MAX];
    int gone = 0;
    int rc = cgpu_relay_answer(conn, socket, msg, sizeof(msg), &gone);
    if (rc == 0 && take_instance(msg, bundle_abs, id, b) < 0) {
        char named[81] = {0};
        memcpy(named, msg + 9, strnlen(msg + 9, sizeof(named) - 1));
        snprintf(msg, sizeof(msg), "cgpud named an instance the shim cannot use: %s", named);
        rc = -1;
    }
    if (fifo_in_place(&s) && (rc != 0 || stream_restore(&s) < 0)) {
        /* Refused, or cgpud went away, before any spec was there to read. */
        stream_abandon(&s, runtime, child);
        if (gone)
            return;
        die(1, "%s", rc != 0 ? msg : "could not put the bundle's config.json back for the runtime");
    }
    /* At config.json now: cgpud's edit, or the engine's spec put back (the
     * bundle asked for no GPU). runc reads it there or from the FIFO. */
    int spec = openat(s.dir, "config.json", O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (spec < 0 || fstat(spec, &st) < 0 || !S_ISREG(st.st_mode)) {
        if (spec >= 0)
            close(spec);
        stream_abandon(&s, runtime, child); /* nothing for it to have read */
        die(1, "%s", rc != 0 ? msg : "the bundle's config.json is gone after cgpud prepared it");
    }
    fcntl(s.fifo, F_SETPIPE_SZ, (int)(st.st_size < (1 << 20) ? st.st_size + 1 : (1 << 20)));
    int fed = copy_spec(spec, s.fifo, child);
    close(spec);
    int code = wait_streamed(runtime, child, &s);
    stream_close(&s);
    if (rc != 0 || fed < 0) {
        /* No start without cgpud's ok on the spec runc read: cgpud edited
         * the bundle and then failed or went away, or the hand-over broke. */
        char ignored[CGPU_RELAY_MSG_MAX];
        if (code == 0)
            force_delete(runtime, argv, cmd, id);
        if (b->instance[0])
            relay_bound(socket, "release", b, 0, ignored, sizeof(ignored));
        die(1, "%s", rc != 0 ? msg : "could not hand the prepared spec to the runtime");
    }
    if (!b->instance[0])
        exit(code); /* no GPU asked for: runc's create as it was, nothing to bind */
    bind_created(runtime, argv, cmd, socket, b, code);
}

/* The streamed create the front began (runtime_front.c, front_stream; the
 * hand-over in STREAM_ENV), carried on as create_streamed() would after its
 * own first steps. Returns only to go the usual way, the bundle as it was;
 * a hand-over that does not hold together stops the start. */
static void stream_adopt(const char *runtime, char **argv, int cmd, const char *socket, struct shim_bound *b,
                         const char *handed)
{
    long v[5];
    const char *p = handed;
    int bad = 0;
    for (int i = 0; i < 5 && !bad; i++) {
        char *end;
        errno = 0;
        v[i] = strtol(p, &end, 10);
        bad = errno || end == p || *end != (i < 4 ? ',' : '\0') || v[i] < -1 || v[i] > INT_MAX ||
              (i < 4 && v[i] >= 0 && v[i] < 3);
        p = end + 1;
    }
    unsetenv(STREAM_ENV); /* not the real runtime's */
    const char *bundle = ".", *id = NULL;
    parse_create(argv + cmd + 1, &bundle, &id, NULL);
    char bundle_abs[PATH_MAX];
    struct streamed s = {.dir = bad ? -1 : (int)v[1], .original = bad ? -1 : (int)v[2], .fifo = bad ? -1 : (int)v[3]};
    pid_t child = bad ? -1 : (pid_t)v[4];
    int conn = bad ? -1 : (int)v[0];
    siginfo_t info = {0};
    struct stat bundle_st;
    /* Each descriptor is what the front says it is: the bundle's directory,
     * a regular file, a FIFO (cgpud may have renamed its edit over it by
     * now); runc a child of ours. */
    int held = !bad && id && valid_container_id(id) && realpath(bundle, bundle_abs) && stat(bundle_abs, &bundle_st) == 0 &&
               s.dir >= 0 && fstat(s.dir, &s.original_st) == 0 && S_ISDIR(s.original_st.st_mode) &&
               s.original_st.st_dev == bundle_st.st_dev && s.original_st.st_ino == bundle_st.st_ino &&
               s.original >= 0 && fstat(s.original, &s.original_st) == 0 && S_ISREG(s.original_st.st_mode) &&
               s.fifo >= 0 && fstat(s.fifo, &s.fifo_st) == 0 && S_ISFIFO(s.fifo_st.st_mode) &&
               fcntl(s.dir, F_SETFD, FD_CLOEXEC) == 0 && fcntl(s.original, F_SETFD, FD_CLOEXEC) == 0 &&
               fcntl(s.fifo, F_SETFD, FD_CLOEXEC) == 0 &&
               (child == -1 || (child > 1 && waitid(P_PID, (id_t)child, &info, WEXITED | WNOHANG | WNOWAIT) == 0));
    if (!held) {
        if (!bad && child > 1 && waitid(P_PID, (id_t)child, &info, WEXITED | WNOHANG | WNOWAIT) == 0)
            kill(child, SIGKILL); /* ours, and it cannot be given a spec */
        die(1, "the start cgpu-runtime began cannot be carried on (" STREAM_ENV "=%.80s): run containers through "
               "cgpu-runtime, not " CGPU_RUNTIME_GPU_PROGRAM " itself",
            handed);
    }
    snprintf(s.tmp, sizeof(s.tmp), STREAM_TMP_PREFIX "%ld", (long)getpid());
    struct timeval tv = {.tv_sec = CGPU_RELAY_TIMEOUT_S};
    if (conn >= 0 && (relay_connection(conn, socket) < 0 || setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0)) {
        close(conn);
        conn = -1;
    }
    if (conn < 0) {
        /* The prepare did not go out: undone, and asked the usual way. */
        stream_abandon(&s, runtime, child > 1 ? child : 0);
        return;
    }
    stream_run(runtime, argv, cmd, socket, b, &s, conn, child > 1 ? child : start_runtime(runtime, argv), bundle_abs, id);
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
        const char *handed = getenv(STREAM_ENV);
        if (handed && runtime_streams_spec(runtime))
            stream_adopt(runtime, argv, cmd, socket, &b, handed);
        else if (runtime_streams_spec(runtime) && getenv(SENT_FD_ENV) == NULL)
            create_streamed(runtime, argv, cmd, socket, &b);
        prepare(argv[cmd], argv + cmd + 1, socket, &b);
        if (b.instance[0])
            create_and_bind(runtime, argv, cmd, socket, &b);
    } else if (argv[cmd] && (strcmp(argv[cmd], "create") == 0 || strcmp(argv[cmd], "run") == 0)) {
        prepare(argv[cmd], argv + cmd + 1, socket, NULL);
    }
    run_real_runtime(runtime, argv);
}
