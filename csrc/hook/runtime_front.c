/* cgpu-runtime: what containerd and docker run instead of runc, for every
 * command of every container. It execs the real runtime (CGPU_REAL_RUNTIME,
 * or runc on PATH) with the same arguments, unless the command needs the
 * shim proper, cgpu-runtime-gpu in the same directory (cgpu_runtime.c):
 * `create` or `run` of a bundle whose config.json may ask for a GPU share
 * (runtime_rules.h), `--version`, or a real runtime that cannot be run (the
 * shim proper says why, in runc's log too). For a GPU `create --pid-file`
 * with runc it first begins the streamed start itself (front_stream) and
 * hands it on.
 *
 * Built without libc on x86-64 and aarch64 (its few system calls are in
 * mini_sys.h): a glibc program's start-up alone cost about 0.4 ms per
 * command on the machines measured, three commands a container, where an
 * execve of this costs next to nothing (bench/bench_runtime_exec.py).
 * Elsewhere, and in the sanitizer builds, it is an ordinary libc program
 * with the same logic. Nothing is allocated; one thread. */
#if !defined(CGPU_FRONT_FREESTANDING)
#define _GNU_SOURCE
#endif
#include <stddef.h>

#include "runtime_rules.h"

#define PROG "cgpu-runtime"
#define GPU_SHIM CGPU_RUNTIME_GPU_PROGRAM /* runtime_rules.h includes relay_wire.h */
#define PATH_BYTES 4096 /* PATH_MAX */
#define DEFAULT_PATH "/bin:/usr/bin" /* what execvp searches when PATH is unset */

#include "mini_sys.h"

/* ---- the decision ---------------------------------------------------------------------- */

/* The raw-byte rule over the bundle's config.json, read as the shim proper
 * reads it (runtime_rules.h; cgpu_runtime.c read_config). */
static enum config_kind scan_config(const char *bundle)
{
    static char buf[CONFIG_BUF];
    char path[PATH_BYTES];
    size_t n = rr_strlen(bundle);
    if (n + sizeof("/config.json") > sizeof(path))
        return CONFIG_UNREADABLE;
    memcpy(path, bundle, n);
    memcpy(path + n, "/config.json", sizeof("/config.json"));
    /* O_NONBLOCK: opening a FIFO must not hang the start path. */
    int fd = f_open(path, OPEN_CONFIG);
    if (fd < 0)
        return CONFIG_UNREADABLE;
    unsigned long long size;
    enum config_kind kind = CONFIG_UNREADABLE;
    int regular = f_regular(fd, &size);
    if (regular <= 0)
        goto out;
    /* Too big to scan cheaply: the shim proper lets cgpud decide. */
    kind = CONFIG_MAY_ASK;
    if (size > CONFIG_MAX)
        goto out;
    kind = scan_config_reads(fd, buf, f_read);
out:
    f_close(fd);
    return kind;
}

/* The value of an environment entry "name=value", or NULL if it names another variable. */
static const char *entry_value(const char *entry, const char *name)
{
    size_t i = 0;
    while (name[i] && entry[i] == name[i])
        i++;
    return !name[i] && entry[i] == '=' ? entry + i + 1 : NULL;
}

static const char *env_value(char *const *envp, const char *name)
{
    for (; *envp; envp++) {
        const char *v = entry_value(*envp, name);
        if (v)
            return v;
    }
    return NULL;
}

/* `dir`/`name` into out (NUL-terminated); 0 if it does not fit. */
static int join(char *out, const char *dir, size_t dir_len, const char *name)
{
    size_t n = rr_strlen(name);
    if (dir_len + 1 + n + 1 > PATH_BYTES)
        return 0;
    memcpy(out, dir, dir_len);
    out[dir_len] = '/';
    memcpy(out + dir_len + 1, name, n + 1);
    return 1;
}

/* execvp's search, returning only if no candidate could be run. */
static void exec_runtime(const char *runtime, char **argv, char *const *envp)
{
    argv[0] = (char *)runtime;
    for (const char *c = runtime; *c; c++)
        if (*c == '/') {
            f_execve(runtime, argv, envp);
            return;
        }
    const char *path = env_value(envp, "PATH");
    if (!path)
        path = DEFAULT_PATH;
    char candidate[PATH_BYTES];
    for (const char *p = path;; p++) {
        const char *end = p;
        while (*end && *end != ':')
            end++;
        /* An empty entry is the current directory, as for execvp. */
        if (join(candidate, end > p ? p : ".", end > p ? (size_t)(end - p) : 1, runtime)) {
            int err = f_execve(candidate, argv, envp);
            if (err != -E_NOENT && err != -E_NOTDIR && err != -E_ACCES)
                return;
        }
        if (!*end)
            return;
        p = end;
    }
}

static void say(const char *a, const char *b, const char *c)
{
    f_write(2, PROG ": ", sizeof(PROG ": ") - 1);
    f_write(2, a, rr_strlen(a));
    f_write(2, b, rr_strlen(b));
    f_write(2, c, rr_strlen(c));
    f_write(2, "\n", 1);
}

/* The shim proper's path, beside this program's own file; 0 (and, if
 * `loud`, said why) if it cannot be named. */
static int shim_path(char *shim, int loud)
{
    char self[PATH_BYTES];
    long n = f_readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) {
        if (loud)
            say("cannot find " GPU_SHIM ": /proc/self/exe cannot be read", "", " (is /proc mounted?)");
        return 0;
    }
    self[n] = '\0';
    size_t dir = (size_t)n;
    while (dir > 0 && self[dir - 1] != '/')
        dir--;
    if (dir == 0 || !join(shim, self, dir - 1, GPU_SHIM)) {
        if (loud)
            say("cannot find " GPU_SHIM " beside ", self, "");
        return 0;
    }
    return 1;
}

static _Noreturn void exec_gpu_shim(char **argv, char *const *envp)
{
    static char shim[PATH_BYTES];
    if (!shim_path(shim, 1))
        f_exit(127);
    argv[0] = shim;
    f_execve(shim, argv, envp);
    /* Fails closed: a GPU container must not start without its limits. */
    say("cannot run ", shim, ": it is installed with cgpu-runtime, in the same directory; reinstall cgpu");
    f_exit(127);
}

/* Decimal digits of v at out (no NUL); how many. */
static size_t put_decimal(char *out, unsigned long v)
{
    char tmp[24];
    size_t n = 0;
    do
        tmp[n++] = (char)('0' + v % 10);
    while ((v /= 10) != 0);
    for (size_t i = 0; i < n; i++)
        out[i] = tmp[n - 1 - i];
    return n;
}

/* What realpath(3) gives for a directory: the kernel's name for it, opened. */
static int bundle_path(const char *bundle, char *out, size_t size)
{
    int dir = f_open(bundle, OPEN_BUNDLE);
    if (dir < 0)
        return 0;
    char link[sizeof("/proc/self/fd/") + 24];
    size_t k = sizeof("/proc/self/fd/") - 1;
    memcpy(link, "/proc/self/fd/", k);
    link[k + put_decimal(link + k, (unsigned long)dir)] = '\0';
    long n = f_readlink(link, out, size - 1);
    f_close(dir);
    if (n <= 0 || out[0] != '/')
        return 0;
    out[n] = '\0';
    return 1;
}

struct f_sockaddr_un {
    unsigned short family;
    char path[108];
};

/* Sends the shim proper's prepare request itself (runtime_rules.h builds
 * the bytes for both), before the exec: cgpud then works on it while the
 * shim starts, which costs a glibc program about half a millisecond. The
 * connected socket, left open for the shim to read the answer on; -1 if
 * anything is off, and the shim then asks itself (and says why, and waits
 * for a restarting cgpud). Nothing here waits: a connect that would (a
 * wedged cgpud's full backlog) gives up, and the request, a few KiB, goes
 * whole into a fresh socket's buffer or not at all. */
/* A non-blocking connection to cgpud's relay socket, or -1: a connect
 * that would wait (a wedged cgpud's full backlog) gives up. */
static int relay_connect(char *const *envp)
{
    const char *relay = env_value(envp, "CGPU_RELAY_SOCKET");
    if (!relay || !*relay)
        relay = CGPU_RELAY_DEFAULT_SOCKET;
    struct f_sockaddr_un addr = {.family = F_AF_UNIX};
    size_t path_len = rr_strlen(relay);
    if (path_len >= sizeof(addr.path))
        return -1;
    memcpy(addr.path, relay, path_len + 1);
    int fd = f_unix_socket();
    if (fd < 0)
        return -1;
    /* Below 3 it would stand for a closed stdio in the runtime. */
    if (fd < 3 || f_connect(fd, &addr, sizeof(addr)) < 0) {
        f_close(fd);
        return -1;
    }
    return fd;
}

static int send_prepare(const char *command, const char *bundle, const char *id, const char *pid_file,
                        char *const *envp)
{
    static char request[CGPU_CONTAINER_ID_MAX + PATH_BYTES + 32];
    char abs[PATH_BYTES];
    if (!id || !valid_container_id(id) || !bundle_path(bundle, abs, sizeof(abs)))
        return -1;
    int shim_binds = rr_streq(command, "create") && pid_file != NULL; /* cgpu_runtime.c main */
    long len = prepare_request(request, sizeof(request), id, abs, shim_binds ? " " CGPU_RELAY_SHIM_BINDS : "");
    if (len < 0)
        return -1;
    int fd = relay_connect(envp);
    if (fd < 0)
        return -1;
    long n;
    do
        n = f_send(fd, request, (size_t)len);
    while (n == -E_INTR);
    if (n != len || f_shutdown_write(fd) < 0)
        goto fail;
    return fd;
fail:
    f_close(fd);
    return -1;
}

/* envp without any inherited SENT_FD_ENV or STREAM_ENV, and with `var`
 * ("NAME=value") if not NULL; NULL if that does not fit. */
static char *const *with_var(char *const *envp, char *var)
{
    static char *env[4096 + 2];
    size_t k = 0;
    for (char *const *e = envp; *e; e++) {
        if (entry_value(*e, SENT_FD_ENV) || entry_value(*e, STREAM_ENV))
            continue;
        if (k == sizeof(env) / sizeof(env[0]) - 2)
            return NULL;
        env[k++] = *e;
    }
    if (var)
        env[k++] = var;
    env[k] = NULL;
    return env;
}

/* envp with SENT_FD_ENV naming `fd` (any inherited value dropped), or envp
 * itself, fd closed, if that does not fit. */
static char *const *with_sent_fd(char *const *envp, int fd)
{
    static char var[sizeof(SENT_FD_ENV "=") + 24];
    if (fd < 0)
        return envp;
    size_t name = sizeof(SENT_FD_ENV "=") - 1;
    memcpy(var, SENT_FD_ENV "=", name);
    var[name + put_decimal(var + name, (unsigned long)fd)] = '\0';
    char *const *env = with_var(envp, var);
    if (!env)
        f_close(fd);
    return env ? env : envp;
}

static const char *real_runtime(char *const *envp)
{
    const char *runtime = env_value(envp, "CGPU_REAL_RUNTIME");
    return runtime && *runtime ? runtime : "runc";
}

/* ---- a streamed create, begun here ----------------------------------------------------- */

/* What cgpu-runtime-gpu's create_streamed() does first, done here instead,
 * so that runc and cgpud's prepare start before the glibc shim proper does
 * (its start-up, 0.4-1 ms on the machines measured, was on the path
 * between the front and runc's exec): the FIFO at config.json, the prepare
 * sent with the engine's spec as its descriptor, runc started. Then the
 * shim proper is exec'd, in this process, so runc stays its child, and
 * takes over from there (STREAM_ENV) as if it had done these steps itself:
 * it reads cgpud's answer, feeds the FIFO or undoes the start, binds.
 * Returns, with nothing changed, if any step before the FIFO's rename
 * fails (the shim proper then does it all, and says what is wrong); after
 * the rename it always hands over, saying how far it got. */
struct front_stream_fds {
    int conn, dir, original, fifo;
};

static void close_stream_fds(struct front_stream_fds *f)
{
    int *fds[] = {&f->conn, &f->dir, &f->original, &f->fifo};
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++)
        if (*fds[i] >= 0) {
            f_close(*fds[i]);
            *fds[i] = -1;
        }
}

/* The FIFO in place of the bundle's config.json, as cgpu_runtime.c's
 * stream_setup() puts it: 1, or 0 with the bundle as it was. */
static int front_fifo(const char *bundle_abs, struct front_stream_fds *f, const char *tmp)
{
    f->dir = f_open(bundle_abs, OPEN_BUNDLE);
    if (f->dir < 0)
        return 0;
    f->original = f_openat(f->dir, "config.json", OPEN_CONFIG, 0);
    long mode = f->original < 0 ? -1 : f_mode(f->original);
    if (mode < 0 || (mode & F_S_IFMT) != S_IFREG || f_mkfifoat(f->dir, tmp, 0600) < 0)
        return 0;
    f->fifo = f_openat(f->dir, tmp, O_RDWR | O_NONBLOCK | O_CLOEXEC, 0);
    /* The engine's mode: cgpud gives the edited spec the mode it finds there. */
    if (f->fifo < 0 || f_fchmod(f->fifo, (int)(mode & 07777)) < 0 || f_renameat(f->dir, tmp, f->dir, "config.json") < 0) {
        f_unlinkat(f->dir, tmp);
        return 0;
    }
    return 1;
}

/* In the child: runc, dying with the process that becomes the shim proper. */
static _Noreturn void front_runtime(int parent, char **argv, char *const *envp)
{
    static const char cannot[] = PROG ": cannot run the real runtime (install runc or set CGPU_REAL_RUNTIME)\n";
    f_die_with_parent();
    if (f_getppid() != parent)
        f_exit(127);
    exec_runtime(real_runtime(envp), argv, envp);
    f_write(2, cannot, sizeof(cannot) - 1);
    f_exit(127);
}

static void front_stream(char **argv, int cmd, char *const *envp)
{
    static char request[CGPU_CONTAINER_ID_MAX + PATH_BYTES + 48];
    static char shim[PATH_BYTES];
    static char var[sizeof(STREAM_ENV "=") + 5 * 24];
    char abs[PATH_BYTES], tmp[sizeof(STREAM_TMP_PREFIX) + 24];
    const char *bundle = ".", *id = NULL;
    parse_create(argv + cmd + 1, &bundle, &id, NULL);
    char *const *clean = with_var(envp, NULL); /* runc's env, as the shim proper gives it */
    int parent = f_getpid();
    long len;
    /* A shim proper that cannot run would leave runc waiting on a FIFO;
     * exec_gpu_shim says why it cannot. */
    if (!clean || !id || !valid_container_id(id) || !bundle_path(bundle, abs, sizeof(abs)) || !shim_path(shim, 0) ||
        !f_executable(shim) ||
        (len = prepare_request(request, sizeof(request), id, abs,
                               " " CGPU_RELAY_SHIM_BINDS " " CGPU_RELAY_SPEC_FD)) < 0)
        return;
    struct front_stream_fds f = {.conn = relay_connect(envp), .dir = -1, .original = -1, .fifo = -1};
    if (f.conn >= 0 && f_cloexec(f.conn, 1) < 0) /* not runc's */
        close_stream_fds(&f);
    size_t k = sizeof(STREAM_TMP_PREFIX) - 1;
    memcpy(tmp, STREAM_TMP_PREFIX, k);
    tmp[k + put_decimal(tmp + k, (unsigned long)parent)] = '\0';
    /* cgpud not there: the shim proper asks, with its wait for a restart. */
    if (f.conn < 0 || !front_fifo(abs, &f, tmp)) {
        close_stream_fds(&f);
        return;
    }
    long sent;
    do
        sent = f_send_fd(f.conn, request, (size_t)len, f.original);
    while (sent == -E_INTR);
    if (sent != len || f_shutdown_write(f.conn) < 0) {
        f_close(f.conn);
        f.conn = -1; /* the shim proper puts the spec back and asks itself */
    }
    long child = -1;
    if (f.conn >= 0) {
        child = f_fork();
        if (child == 0)
            front_runtime(parent, argv, clean);
        if (child < 0)
            child = -1; /* the shim proper starts it */
    }
    /* Across the exec: runc, forked above, has closed its copies. */
    int *fds[] = {&f.conn, &f.dir, &f.original, &f.fifo};
    k = sizeof(STREAM_ENV "=") - 1;
    memcpy(var, STREAM_ENV "=", k);
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++) {
        if (*fds[i] >= 0 && f_cloexec(*fds[i], 0) < 0)
            *fds[i] = -1; /* the shim proper finds it missing and undoes the start */
        if (*fds[i] < 0)
            var[k++] = '-', var[k++] = '1';
        else
            k += put_decimal(var + k, (unsigned long)*fds[i]);
        var[k++] = ',';
    }
    if (child < 0)
        var[k++] = '-', var[k++] = '1';
    else
        k += put_decimal(var + k, (unsigned long)child);
    var[k] = '\0';
    argv[0] = shim;
    f_execve(shim, argv, with_var(envp, var)); /* fits: `clean` did, with room for one more */
    /* Not after the check above but for want of memory: runc dies with
     * this process; the FIFO stays at config.json and the start fails. */
    say("cannot run ", shim, " to carry on a start it began; the bundle's config.json is a FIFO now");
    f_exit(127);
}

static _Noreturn void front_main(int argc, char **argv, char *const *envp)
{
    struct runc_globals g = {0};
    if (argc < 1)
        f_exit(2);
    int cmd = runc_globals(argv, &g);
    if (g.version)
        exec_gpu_shim(argv, envp);
    if (argv[cmd] && (rr_streq(argv[cmd], "create") || rr_streq(argv[cmd], "run"))) {
        const char *bundle = ".", *id = NULL, *pid_file = NULL;
        parse_create(argv + cmd + 1, &bundle, &id, &pid_file);
        if (scan_config(bundle) == CONFIG_MAY_ASK) {
            /* A shim that streams the spec to the runtime asks cgpud itself,
             * with the spec's descriptor, once the FIFO is in place. */
            if (rr_streq(argv[cmd], "create") && pid_file && runtime_streams_spec(real_runtime(envp))) {
                front_stream(argv, cmd, envp);
                exec_gpu_shim(argv, envp);
            }
            exec_gpu_shim(argv, with_sent_fd(envp, send_prepare(argv[cmd], bundle, id, pid_file, envp)));
        }
    }
    exec_runtime(real_runtime(envp), argv, envp);
    exec_gpu_shim(argv, envp); /* it says why the real runtime cannot run */
}

#if defined(CGPU_FRONT_FREESTANDING)
__attribute__((used)) _Noreturn void cgpu_front_start(long *sp);
__attribute__((used)) _Noreturn void cgpu_front_start(long *sp)
{
    int argc = (int)sp[0];
    char **argv = (char **)(sp + 1);
    front_main(argc, argv, argv + argc + 1);
}

#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %ebp, %ebp\n mov %rsp, %rdi\n and $-16, %rsp\n call cgpu_front_start\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n mov x0, sp\n bl cgpu_front_start\n");
#endif
#else
extern char **environ;

int main(int argc, char **argv)
{
    front_main(argc, argv, environ);
}
#endif
