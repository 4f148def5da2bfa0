/* cgpu-runtime: what containerd and docker run instead of runc, for every
 * command of every container. It execs the real runtime (CGPU_REAL_RUNTIME,
 * or runc on PATH) with the same arguments, unless the command needs the
 * shim proper, cgpu-runtime-gpu in the same directory (cgpu_runtime.c):
 * `create` or `run` of a bundle whose config.json may ask for a GPU share
 * (runtime_rules.h), `--version`, or a real runtime that cannot be run (the
 * shim proper says why, in runc's log too).
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

static _Noreturn void exec_gpu_shim(char **argv, char *const *envp)
{
    char self[PATH_BYTES], shim[PATH_BYTES];
    long n = f_readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) {
        say("cannot find " GPU_SHIM ": /proc/self/exe cannot be read", "", " (is /proc mounted?)");
        f_exit(127);
    }
    self[n] = '\0';
    size_t dir = (size_t)n;
    while (dir > 0 && self[dir - 1] != '/')
        dir--;
    if (dir == 0 || !join(shim, self, dir - 1, GPU_SHIM)) {
        say("cannot find " GPU_SHIM " beside ", self, "");
        f_exit(127);
    }
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
static int send_prepare(const char *command, const char *bundle, const char *id, const char *pid_file,
                        char *const *envp)
{
    static char request[CGPU_CONTAINER_ID_MAX + PATH_BYTES + 32];
    char abs[PATH_BYTES];
    if (!id || !valid_container_id(id) || !bundle_path(bundle, abs, sizeof(abs)))
        return -1;
    int shim_binds = rr_streq(command, "create") && pid_file != NULL; /* cgpu_runtime.c main */
    long len = prepare_request(request, sizeof(request), id, abs, shim_binds ? " " CGPU_RELAY_SHIM_BINDS : "");
    const char *relay = env_value(envp, "CGPU_RELAY_SOCKET");
    if (!relay || !*relay)
        relay = CGPU_RELAY_DEFAULT_SOCKET;
    struct f_sockaddr_un addr = {.family = F_AF_UNIX};
    size_t path_len = rr_strlen(relay);
    if (len < 0 || path_len >= sizeof(addr.path))
        return -1;
    memcpy(addr.path, relay, path_len + 1);
    int fd = f_unix_socket();
    if (fd < 0)
        return -1;
    /* Below 3 it would stand for a closed stdio in the runtime. */
    if (fd < 3 || f_connect(fd, &addr, sizeof(addr)) < 0)
        goto fail;
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

/* envp with SENT_FD_ENV naming `fd` (any inherited value dropped), or envp
 * itself, fd closed, if that does not fit. */
static char *const *with_sent_fd(char *const *envp, int fd)
{
    static char *env[4096 + 2];
    static char var[sizeof(SENT_FD_ENV "=") + 24];
    if (fd < 0)
        return envp;
    size_t k = 0, name = sizeof(SENT_FD_ENV "=") - 1;
    for (char *const *e = envp; *e; e++) {
        if (entry_value(*e, SENT_FD_ENV))
            continue;
        if (k == sizeof(env) / sizeof(env[0]) - 2) {
            f_close(fd);
            return envp;
        }
        env[k++] = *e;
    }
    memcpy(var, SENT_FD_ENV "=", name);
    var[name + put_decimal(var + name, (unsigned long)fd)] = '\0';
    env[k++] = var;
    env[k] = NULL;
    return env;
}

static const char *real_runtime(char *const *envp)
{
    const char *runtime = env_value(envp, "CGPU_REAL_RUNTIME");
    return runtime && *runtime ? runtime : "runc";
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
            if (rr_streq(argv[cmd], "create") && pid_file && runtime_streams_spec(real_runtime(envp)))
                exec_gpu_shim(argv, envp);
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
