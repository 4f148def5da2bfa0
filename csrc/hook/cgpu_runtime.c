/* cgpu-runtime: the OCI runtime shim containerd and docker call instead of
 * runc. Every command goes to the real runtime unchanged; before `create` or
 * `run` of a bundle that may ask for a GPU share, cgpud prepares the bundle,
 * and unless it answers ok the container does not start.
 *
 * `create --pid-file` of a GPU container (what containerd and docker run):
 * the shim binds the instance to the init pid itself once the real create
 * succeeded, and releases it at the real delete (first, then exec, when the
 * container's init has exited; after it otherwise), so runc runs no hook of
 * ours (a hook is a fork+exec of cgpu-hook by runc at each stage). A marker
 * file under CGPU_RUNTIME_STATE_DIR says which containers those are, so a
 * delete of any other container is a plain exec of the real runtime.
 * `run`, and `create` without --pid-file, keep the OCI hooks. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "relay.h"

#define PROG "cgpu-runtime"
#define CONFIG_MAX (8 << 20)
#define CONFIG_CHUNK (64 << 10)
#define ID_MAX CGPU_CONTAINER_ID_MAX
#define INSTANCE_MAX 63
#define STATE_DIR "/run/cgpu-runtime"
#define RUNC_ROOT "/run/runc" /* runc's --root default for root */
#define MARKER_MAX (2 * PATH_MAX + ID_MAX + INSTANCE_MAX + 8)
#define SHIM_BINDS "shim-binds" /* relay.py SHIM_BINDS */

/* A bundle may ask for a GPU share only if its config names one of these,
 * or spells a name or path character as a JSON escape (see escaped_name).
 * "/cgpu", not "\"/run/cgpu\"" (CGPU_REGION_FIXED_DIR): cgpud reads a mount
 * at /run/cgpu/, /run//cgpu or /run/cgpu/usage as a claim too (or refuses
 * it), and every spelling of such a path holds "/cgpu" unescaped. */
static const char *const MARKERS[] = {CGPU_ENV_PREFIX, "/cgpu", "\\/"};
/* The longest marker - 1: a marker may straddle two reads. */
#define MARKER_KEEP (sizeof(CGPU_ENV_PREFIX) - 2)
_Static_assert(sizeof(CGPU_ENV_PREFIX) >= sizeof("/cgpu"), "MARKER_KEEP assumes the prefix is the longest marker");
_Static_assert(MARKER_KEEP >= 5, "escaped_name leaves up to 5 bytes of an escape to the next read");

/* Value-taking flags; every other flag is taken as boolean. */
static const char *const GLOBAL_VALUED[] = {"root", "log", "log-format", "criu", "rootless", NULL};
static const char *const CREATE_VALUED[] = {"bundle", "b", "console-socket", "pid-file", "preserve-fds", NULL};

struct globals {
    const char *root;
    const char *log;
    const char *log_format;
    int version;
};

static struct globals g_opts;

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

/* runc parses flags with Go's flag package: "-name" and "--name" are the
 * same flag, and a value follows "=" or comes as the next argument. Returns
 * the index in `names` of the flag `arg` is, or -1; *value is the "=" part. */
static int flag_index(const char *arg, const char *const *names, const char **value)
{
    const char *p = arg + 1 + (arg[1] == '-');
    for (int k = 0; names[k]; k++) {
        size_t n = strlen(names[k]);
        if (strncmp(p, names[k], n) == 0 && (p[n] == '\0' || p[n] == '=')) {
            *value = p[n] == '=' ? p + n + 1 : NULL;
            return k;
        }
    }
    return -1;
}

static int is_flag(const char *arg)
{
    return arg[0] == '-' && arg[1] != '\0';
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
    int i = 1;
    while (argv[i] && is_flag(argv[i])) {
        const char *a = argv[i++], *v;
        if (strcmp(a, "--") == 0)
            break;
        if (flag_index(a, (const char *const[]){"version", "v", NULL}, &v) >= 0)
            g_opts.version = 1;
        int k = flag_index(a, GLOBAL_VALUED, &v);
        if (k < 0)
            continue;
        if (!v && argv[i])
            v = argv[i++];
        if (k == 0)
            g_opts.root = v;
        else if (k == 1)
            g_opts.log = v;
        else if (k == 2)
            g_opts.log_format = v;
    }
    return i;
}

/* urfave/cli lets flags follow the container id, so the id is the last
 * argument that is neither a flag nor a flag's value. */
static void parse_create(char **args, const char **bundle, const char **id, const char **pid_file)
{
    int flags = 1;
    for (int i = 0; args[i]; i++) {
        const char *a = args[i], *v;
        if (flags && strcmp(a, "--") == 0) {
            flags = 0;
            continue;
        }
        if (!flags || !is_flag(a)) {
            *id = a;
            continue;
        }
        int k = flag_index(a, CREATE_VALUED, &v);
        if (k < 0)
            continue;
        if (!v && args[i + 1])
            v = args[++i];
        if (k <= 1 && v)
            *bundle = v;
        else if (k == 3 && pid_file)
            *pid_file = v && *v ? v : NULL;
    }
}

enum config_kind { CONFIG_UNREADABLE, CONFIG_PLAIN, CONFIG_MAY_ASK };

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* A \uXXXX escape of a letter, digit, '_' or '/' could spell a request's
 * name or /run/cgpu. Encoders never escape those on their own, while Go's
 * (containerd's, dockerd's) escapes '&', '<' and '>': so "sh -c 'a && b'"
 * stays on the fast path that works even with cgpud down. */
static int escaped_name(const char *buf, size_t len)
{
    for (const char *p = buf; (p = memmem(p, len - (size_t)(p - buf), "\\u", 2)) != NULL; p += 2) {
        if ((size_t)(p - buf) + 6 > len)
            return 0; /* kept for the next read: MARKER_KEEP covers 5 bytes */
        int code = 0;
        for (int i = 2; i < 6; i++) {
            int h = hexval(p[i]);
            if (h < 0) {
                code = -1;
                break;
            }
            code = code * 16 + h;
        }
        if ((code >= '/' && code <= '9') || (code >= 'A' && code <= 'Z') || code == '_' ||
            (code >= 'a' && code <= 'z'))
            return 1;
    }
    return 0;
}

/* Decides from the raw bytes, without parsing JSON: this runs before every
 * container start on the node, most of which ask for no GPU. */
static enum config_kind read_config(const char *bundle)
{
    static char buf[MARKER_KEEP + CONFIG_CHUNK];
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
    size_t keep = 0, total = 0;
    for (;;) {
        ssize_t n = read(fd, buf + keep, CONFIG_CHUNK);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            kind = CONFIG_UNREADABLE;
            goto out;
        }
        if (n == 0)
            break;
        size_t have = keep + (size_t)n;
        for (size_t m = 0; m < sizeof(MARKERS) / sizeof(MARKERS[0]); m++)
            if (memmem(buf, have, MARKERS[m], strlen(MARKERS[m])))
                goto out;
        if (escaped_name(buf, have))
            goto out;
        total += (size_t)n;
        if (total > CONFIG_MAX)
            goto out;
        keep = have < MARKER_KEEP ? have : MARKER_KEEP;
        memmove(buf, buf + have - keep, keep);
    }
    kind = CONFIG_PLAIN;
out:
    close(fd);
    return kind;
}

static int valid_id(const char *id)
{
    size_t n = 0;
    for (; id[n]; n++)
        if (id[n] <= ' ' || id[n] > '~')
            return 0;
    return n > 0 && n <= ID_MAX;
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
    char bundle_abs[PATH_MAX];
    /* A bundle that does not resolve is the runtime's error to report. */
    if (!realpath(bundle, bundle_abs))
        return;
    enum config_kind kind = read_config(bundle_abs);
    if (kind != CONFIG_MAY_ASK)
        return;
    if (!id)
        die(1, "container id missing: usage is %s [options] <container-id>", command);
    if (!valid_id(id))
        die(1, "container id is not valid: expected 1-%d printable ASCII characters without spaces", ID_MAX);
    static char request[ID_MAX + PATH_MAX + 32];
    int len = snprintf(request, sizeof(request), "prepare %s%s\n%s", id, bound ? " " SHIM_BINDS : "", bundle_abs);
    char msg[CGPU_RELAY_MSG_MAX];
    if (cgpu_relay_call(PROG, socket, request, (size_t)len, msg, sizeof(msg)) != 0)
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

static uint64_t fnv1a(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 0x100000001b3ULL;
    return h;
}

/* The marker of (runtime root, id): one file named by a hash of both (an id
 * may hold any printable byte), whose content repeats them, so a collision
 * reads as "no marker" rather than another container's. */
static const char *runc_root(void)
{
    return g_opts.root && *g_opts.root ? g_opts.root : RUNC_ROOT;
}

static int state_dir(void)
{
    const char *dir = env_or("CGPU_RUNTIME_STATE_DIR", STATE_DIR);
    if (mkdir(dir, 0700) < 0 && errno != EEXIST)
        return -1;
    return open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

static void marker_name(char *name, size_t size, const char *id)
{
    const char *root = runc_root();
    uint64_t h = fnv1a(0xcbf29ce484222325ULL, root, strlen(root) + 1);
    h = fnv1a(h, id, strlen(id));
    snprintf(name, size, "%016llx", (unsigned long long)h);
}

static int marker_body(char *buf, size_t size, const char *id, const char *instance, const char *bundle)
{
    int n = snprintf(buf, size, "%s\n%s\n%s\n%s\n", runc_root(), id, instance, bundle);
    return n > 0 && (size_t)n < size ? n : -1;
}

/* Written before the real create: a delete, whoever's, then finds it. */
static int write_marker(const struct shim_bound *b)
{
    static char body[MARKER_MAX];
    int n = marker_body(body, sizeof(body), b->id, b->instance, b->bundle);
    int dfd = state_dir();
    if (n < 0 || dfd < 0) {
        if (dfd >= 0)
            close(dfd);
        return -1;
    }
    char name[32], tmp[64];
    marker_name(name, sizeof(name), b->id);
    snprintf(tmp, sizeof(tmp), "%s.%ld", name, (long)getpid());
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    int ok = fd >= 0 && write(fd, body, (size_t)n) == n;
    if (fd >= 0)
        close(fd);
    ok = ok && renameat(dfd, tmp, dfd, name) == 0;
    if (!ok)
        unlinkat(dfd, tmp, 0);
    close(dfd);
    return ok ? 0 : -1;
}

static void remove_marker(const char *id)
{
    int dfd = state_dir();
    if (dfd < 0)
        return;
    char name[32];
    marker_name(name, sizeof(name), id);
    unlinkat(dfd, name, 0);
    close(dfd);
}

/* Fills b from the marker of `id`; 0 if there is one that names it. */
static int read_marker(const char *id, struct shim_bound *b)
{
    const char *dir = env_or("CGPU_RUNTIME_STATE_DIR", STATE_DIR);
    char name[32], path[PATH_MAX];
    marker_name(name, sizeof(name), id);
    if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path))
        return -1;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return -1; /* the common case: not a container the shim bound */
    static char buf[MARKER_MAX + 1];
    ssize_t n = read(fd, buf, MARKER_MAX);
    close(fd);
    if (n <= 0 || n >= MARKER_MAX)
        return -1;
    buf[n] = '\0';
    char *f[4], *p = buf;
    for (int i = 0; i < 4; i++) {
        char *nl = strchr(p, '\n');
        if (!nl)
            return -1;
        *nl = '\0';
        f[i] = p;
        p = nl + 1;
    }
    size_t len = strlen(f[2]);
    if (strcmp(f[0], runc_root()) != 0 || strcmp(f[1], id) != 0 || len == 0 || len > INSTANCE_MAX ||
        strlen(f[3]) >= sizeof(b->bundle) || f[3][0] != '/')
        return -1;
    memcpy(b->instance, f[2], len + 1);
    snprintf(b->bundle, sizeof(b->bundle), "%s", f[3]);
    b->id = id;
    return 0;
}

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
 * shim killed meanwhile takes the runtime with it, as when it exec'd it. */
static int spawn_runtime(const char *runtime, char **argv)
{
    pid_t parent = getpid();
    pid_t child = fork();
    if (child < 0)
        die(127, "cannot run %s: fork: %s", runtime, strerror(errno));
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        argv[0] = (char *)runtime;
        execvp(runtime, argv);
        cgpu_relay_report(PROG, "cannot run the real runtime (install runc or set CGPU_REAL_RUNTIME)");
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
    if (write_marker(b) != 0) {
        int err = errno;
        relay_bound(socket, "release", b, 0, ignored, sizeof(ignored));
        die(1, "cannot record container %s under %s: %s", b->id, env_or("CGPU_RUNTIME_STATE_DIR", STATE_DIR),
            strerror(err));
    }
    int code = spawn_runtime(runtime, argv);
    if (code != 0) {
        /* runc said why; the instance made for this start goes. */
        relay_bound(socket, "release", b, 0, ignored, sizeof(ignored));
        remove_marker(b->id);
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
    remove_marker(b->id);
    die(1, "%s", msg);
}

/* The unsigned number after `"key":` in `json` (`len` bytes, NUL after). */
static int json_number(const char *json, size_t len, const char *key, unsigned long long *out)
{
    char needle[64];
    int n = snprintf(needle, sizeof(needle), "\"%s\":", key);
    const char *at = memmem(json, len, needle, (size_t)n);
    if (!at || at + n >= json + len || *(at + n) < '0' || *(at + n) > '9')
        return -1;
    char *end;
    errno = 0;
    *out = strtoull(at + n, &end, 10);
    return errno || end >= json + len || (*end != ',' && *end != '}') ? -1 : 0;
}

/* The start time (clock ticks since boot) of a live, non-zombie process, or
 * 0 if there is none. proc(5): field 22 of stat, counted after the last
 * ')' since the command name may hold anything. */
static unsigned long long live_start_time(unsigned long long pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%llu/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ' || p[2] == 'Z' || p[2] == 'X')
        return 0;
    p += 2; /* field 3, the state */
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p)
            p++;
    }
    return p ? strtoull(p, NULL, 10) : 0;
}

/* 1 if the container's init has exited (a stopped container: nothing of it
 * runs), as the real runtime's state records it (runc's state.json: the
 * init's pid and start time, so a pid reused since reads as exited). 0 when
 * it runs, or cannot be told (another runtime's state, a damaged file). */
static int init_exited(const char *id)
{
    char path[PATH_MAX], state[4096];
    if (snprintf(path, sizeof(path), "%s/%s/state.json", runc_root(), id) >= (int)sizeof(path))
        return 0;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, state, sizeof(state) - 1);
    close(fd);
    if (n > 0)
        state[n] = '\0'; /* the fields come first in runc's file; one cut off reads as unknown */
    unsigned long long pid, start;
    if (n <= 0 || json_number(state, (size_t)n, "init_process_pid", &pid) != 0 ||
        json_number(state, (size_t)n, "init_process_start", &start) != 0 || pid <= 1 || start == 0)
        return 0;
    return live_start_time(pid) != start;
}

/* Returns only if the container is none the shim bound, or is stopped and
 * released already: exec the runtime. */
static void delete_and_release(const char *runtime, char **argv, int cmd, const char *socket)
{
    const char *bundle = NULL, *id = NULL;
    parse_create(argv + cmd + 1, &bundle, &id, NULL);
    struct shim_bound b = {0};
    if (!id || read_marker(id, &b) != 0)
        return;
    char msg[CGPU_RELAY_MSG_MAX];
    if (init_exited(id)) {
        /* Nothing of a stopped container runs: its instance can go before
         * the runtime deletes it, and the runtime is exec'd, not waited for.
         * A running one (delete refused, or --force) is released after. */
        if (relay_bound(socket, "release", &b, 0, msg, sizeof(msg)) != 0)
            cgpu_relay_report(PROG, msg);
        remove_marker(id);
        return;
    }
    int code = spawn_runtime(runtime, argv);
    char path[PATH_MAX];
    struct stat st;
    /* Gone from the runtime's root (deleted now, or before): release. */
    if (snprintf(path, sizeof(path), "%s/%s", runc_root(), id) >= (int)sizeof(path) || lstat(path, &st) == 0 ||
        errno != ENOENT)
        exit(code);
    /* As runc treats a failed poststop hook: said, but the delete stands;
     * cgpud's sweep frees the instance once its processes are gone. */
    if (relay_bound(socket, "release", &b, 0, msg, sizeof(msg)) != 0)
        cgpu_relay_report(PROG, msg);
    remove_marker(id);
    exit(code);
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
    } else if (argv[cmd] && strcmp(argv[cmd], "delete") == 0) {
        delete_and_release(runtime, argv, cmd, socket);
    }
    run_real_runtime(runtime, argv);
}
