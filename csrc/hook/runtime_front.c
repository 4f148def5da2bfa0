/* cgpu-runtime: what containerd and docker run instead of runc, for every
 * command of every container. It execs the real runtime (CGPU_REAL_RUNTIME,
 * or runc on PATH) with the same arguments, unless the command needs the
 * shim proper, cgpu-runtime-gpu in the same directory (cgpu_runtime.c):
 * `create` or `run` of a bundle whose config.json may ask for a GPU share
 * (runtime_rules.h), `--version`, or a real runtime that cannot be run (the
 * shim proper says why, in runc's log too).
 *
 * Built without libc on x86-64 and aarch64 (its few system calls are
 * written here): a glibc program's start-up alone cost about 0.4 ms per
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

#if defined(CGPU_FRONT_FREESTANDING)
/* ---- system calls, without libc -------------------------------------------------------- */
#include <asm/stat.h>
#include <asm/unistd.h>
#include <linux/fcntl.h>
#include <linux/stat.h>

/* The generic Linux numbers, which x86-64 and aarch64 both use. */
#define E_NOENT 2
#define E_INTR 4
#define E_ACCES 13
#define E_NOTDIR 20

static long sys6(long n, long a, long b, long c, long d, long e, long f)
{
#if defined(__x86_64__)
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
#else
#error "CGPU_FRONT_FREESTANDING needs x86-64 or aarch64"
#endif
}

static int f_open(const char *path, int flags)
{
    return (int)sys6(__NR_openat, AT_FDCWD, (long)path, flags, 0, 0, 0);
}

static long f_read(int fd, char *buf, size_t n)
{
    return sys6(__NR_read, fd, (long)buf, (long)n, 0, 0, 0);
}

static void f_close(int fd)
{
    sys6(__NR_close, fd, 0, 0, 0, 0, 0);
}

/* 1 and the size if fd is a regular file, 0 if not, -1 on error. fstat,
 * not statx: kernels before 4.11 (CentOS 7's 3.10) have no statx, and an
 * unreadable config would send a GPU start to runc without its limits. */
static int f_regular(int fd, unsigned long long *size)
{
    struct stat st;
    if (sys6(__NR_fstat, fd, (long)&st, 0, 0, 0, 0) < 0)
        return -1;
    *size = (unsigned long long)st.st_size;
    return (st.st_mode & S_IFMT) == S_IFREG;
}

/* Returns only on failure: -errno. */
static int f_execve(const char *path, char *const *argv, char *const *envp)
{
    return (int)sys6(__NR_execve, (long)path, (long)argv, (long)envp, 0, 0, 0);
}

static long f_readlink(const char *path, char *buf, size_t n)
{
    return sys6(__NR_readlinkat, AT_FDCWD, (long)path, (long)buf, (long)n, 0, 0);
}

static void f_write(int fd, const char *buf, size_t n)
{
    sys6(__NR_write, fd, (long)buf, (long)n, 0, 0, 0);
}

static _Noreturn void f_exit(int code)
{
    for (;;)
        sys6(__NR_exit_group, code, 0, 0, 0, 0, 0);
}

/* The generic Linux values, which x86-64 and aarch64 both use. */
#define F_AF_UNIX 1
#define F_SOCK_STREAM 1
#define F_SOCK_NONBLOCK 04000 /* O_NONBLOCK */
#define F_MSG_NOSIGNAL 0x4000
#define F_SHUT_WR 1

/* A non-blocking unix stream socket, kept open across execve; -errno. */
static int f_unix_socket(void)
{
    return (int)sys6(__NR_socket, F_AF_UNIX, F_SOCK_STREAM | F_SOCK_NONBLOCK, 0, 0, 0, 0);
}

static int f_connect(int fd, const void *addr, size_t len)
{
    return (int)sys6(__NR_connect, fd, (long)addr, (long)len, 0, 0, 0);
}

static long f_send(int fd, const char *buf, size_t n)
{
    return sys6(__NR_sendto, fd, (long)buf, (long)n, F_MSG_NOSIGNAL, 0, 0);
}

static int f_shutdown_write(int fd)
{
    return (int)sys6(__NR_shutdown, fd, F_SHUT_WR, 0, 0, 0, 0);
}

#define OPEN_CONFIG (O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
#define OPEN_BUNDLE (O_PATH | O_DIRECTORY | O_CLOEXEC)

/* The compiler may call these for copies and zeroing; there is no libc to
 * provide them. */
void *memcpy(void *dst, const void *src, size_t n);
void *memset(void *dst, int c, size_t n);
void *memmove(void *dst, const void *src, size_t n);
int memcmp(const void *a, const void *b, size_t n);

void *memcpy(void *dst, const void *src, size_t n)
{
    return memmove(dst, src, n);
}

void *memmove(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s)
        for (size_t i = 0; i < n; i++)
            d[i] = s[i];
    else
        for (size_t i = n; i > 0; i--)
            d[i - 1] = s[i - 1];
    return dst;
}

void *memset(void *dst, int c, size_t n)
{
    unsigned char *d = dst;
    for (size_t i = 0; i < n; i++)
        d[i] = (unsigned char)c;
    return dst;
}

int memcmp(const void *a, const void *b, size_t n)
{
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return x[i] - y[i];
    return 0;
}

#else
/* ---- the same calls through libc ------------------------------------------------------- */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define E_NOENT ENOENT
#define E_NOTDIR ENOTDIR
#define E_ACCES EACCES
#define E_INTR EINTR
#define OPEN_CONFIG (O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
#define OPEN_BUNDLE (O_PATH | O_DIRECTORY | O_CLOEXEC)

static int f_open(const char *path, int flags)
{
    int fd = open(path, flags);
    return fd < 0 ? -errno : fd;
}

static long f_read(int fd, char *buf, size_t n)
{
    ssize_t got = read(fd, buf, n);
    return got < 0 ? -errno : got;
}

static void f_close(int fd)
{
    close(fd);
}

static int f_regular(int fd, unsigned long long *size)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        return -1;
    *size = (unsigned long long)st.st_size;
    return S_ISREG(st.st_mode);
}

static int f_execve(const char *path, char *const *argv, char *const *envp)
{
    execve(path, argv, envp);
    return -errno;
}

static long f_readlink(const char *path, char *buf, size_t n)
{
    ssize_t got = readlink(path, buf, n);
    return got < 0 ? -errno : got;
}

static void f_write(int fd, const char *buf, size_t n)
{
    ssize_t done = write(fd, buf, n);
    (void)done; /* nowhere left to report it */
}

static _Noreturn void f_exit(int code)
{
    _exit(code);
}

#define F_AF_UNIX AF_UNIX

static int f_unix_socket(void)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    return fd < 0 ? -errno : fd;
}

static int f_connect(int fd, const void *addr, size_t len)
{
    return connect(fd, addr, (socklen_t)len) < 0 ? -errno : 0;
}

static long f_send(int fd, const char *buf, size_t n)
{
    ssize_t done = send(fd, buf, n, MSG_NOSIGNAL);
    return done < 0 ? -errno : done;
}

static int f_shutdown_write(int fd)
{
    return shutdown(fd, SHUT_WR) < 0 ? -errno : 0;
}
#endif

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
