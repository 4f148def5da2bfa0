/* What cgpu-runtime decides before it runs anything: where runc's command
 * and create's bundle are among its arguments, and whether a config.json
 * may ask for a GPU, judged from its raw bytes. One copy for the front
 * (runtime_front.c, which runs every command of every container and is
 * built without libc) and the shim proper (cgpu_runtime.c); so nothing
 * here calls libc. Pure functions over caller-owned memory, no state:
 * safe from any thread. */
#ifndef CGPU_HOOK_RUNTIME_RULES_H
#define CGPU_HOOK_RUNTIME_RULES_H

#include <stddef.h>

#include "cgpu/relay_wire.h"

#define CONFIG_MAX (8 << 20)
#define CONFIG_CHUNK (64 << 10)

/* A bundle may ask for a GPU share only if its config names one of these,
 * or spells a name or path character as a JSON escape (see escaped_name).
 * "/cgpu", not "\"/run/cgpu\"" (CGPU_REGION_FIXED_DIR): cgpud reads a mount
 * at /run/cgpu/, /run//cgpu or /run/cgpu/usage as a claim too (or refuses
 * it), and every spelling of such a path holds "/cgpu" unescaped. A bundle
 * naming the toolkit's variable goes to cgpud too, which takes away a GPU it
 * would reach without an instance. */
static const char *const MARKERS[] = {CGPU_ENV_PREFIX, "/cgpu", "\\/", CGPU_TOOLKIT_ENV};
/* The longest marker - 1: a marker may straddle two reads. */
#define MARKER_KEEP (sizeof(CGPU_TOOLKIT_ENV) - 2)
_Static_assert(sizeof(CGPU_TOOLKIT_ENV) >= sizeof(CGPU_ENV_PREFIX) && sizeof(CGPU_TOOLKIT_ENV) >= sizeof("/cgpu"),
               "MARKER_KEEP assumes the toolkit's variable is the longest marker");
_Static_assert(MARKER_KEEP >= 5, "escaped_name leaves up to 5 bytes of an escape to the next read");

/* Value-taking flags; every other flag is taken as boolean. */
static const char *const GLOBAL_VALUED[] = {"root", "log", "log-format", "criu", "rootless", NULL};
static const char *const CREATE_VALUED[] = {"bundle", "b", "console-socket", "pid-file", "preserve-fds", NULL};

enum config_kind { CONFIG_UNREADABLE, CONFIG_PLAIN, CONFIG_MAY_ASK };

/* The front's prepare request, already sent (see prepare_request): the
 * connected socket's number, for the shim proper to read the answer on. */
#define SENT_FD_ENV "CGPU_RUNTIME_SENT_FD"

/* A streamed `create` the front began (runtime_front.c, front_stream):
 * "<connection>,<bundle dir>,<engine's config.json>,<FIFO>,<runc's pid>",
 * the four descriptors open across the exec, runc the shim proper's child.
 * The connection is -1 if the prepare could not be sent, the pid -1 if
 * runc could not be started: the shim proper then carries on from there. */
#define STREAM_ENV "CGPU_RUNTIME_STREAM"
#define STREAM_TMP_PREFIX ".config.json.cgpu-" /* + the pid the front and the shim share */


/* The global flags cgpu-runtime reads itself (pointers into argv). */
struct runc_globals {
    const char *log;
    const char *log_format;
    int version;
};

static inline size_t rr_strlen(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

static inline int rr_streq(const char *a, const char *b)
{
    while (*a && *a == *b)
        a++, b++;
    return *a == *b;
}

static inline const char *rr_memmem(const char *hay, size_t n, const char *needle, size_t m)
{
    for (size_t i = 0; m <= n && i <= n - m; i++) {
        size_t k = 0;
        while (k < m && hay[i + k] == needle[k])
            k++;
        if (k == m)
            return hay + i;
    }
    return NULL;
}

/* runc parses flags with Go's flag package: "-name" and "--name" are the
 * same flag, and a value follows "=" or comes as the next argument. Returns
 * the index in `names` of the flag `arg` is, or -1; *value is the "=" part. */
static inline int flag_index(const char *arg, const char *const *names, const char **value)
{
    const char *p = arg + 1 + (arg[1] == '-');
    for (int k = 0; names[k]; k++) {
        size_t n = rr_strlen(names[k]), i = 0;
        while (i < n && p[i] == names[k][i])
            i++;
        if (i == n && (p[n] == '\0' || p[n] == '=')) {
            *value = p[n] == '=' ? p + n + 1 : NULL;
            return k;
        }
    }
    return -1;
}

static inline int is_flag(const char *arg)
{
    return arg[0] == '-' && arg[1] != '\0';
}

/* Index of the command in argv (of its NULL end if none); fills *g. */
static inline int runc_globals(char **argv, struct runc_globals *g)
{
    int i = 1;
    while (argv[i] && is_flag(argv[i])) {
        const char *a = argv[i++], *v;
        if (rr_streq(a, "--"))
            break;
        if (flag_index(a, (const char *const[]){"version", "v", NULL}, &v) >= 0)
            g->version = 1;
        int k = flag_index(a, GLOBAL_VALUED, &v);
        if (k < 0)
            continue;
        if (!v && argv[i])
            v = argv[i++];
        if (k == 1)
            g->log = v;
        else if (k == 2)
            g->log_format = v;
    }
    return i;
}

/* urfave/cli lets flags follow the container id, so the id is the last
 * argument that is neither a flag nor a flag's value. */
static inline void parse_create(char **args, const char **bundle, const char **id, const char **pid_file)
{
    int flags = 1;
    for (int i = 0; args[i]; i++) {
        const char *a = args[i], *v;
        if (flags && rr_streq(a, "--")) {
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

static inline int hexval(char c)
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
static inline int escaped_name(const char *buf, size_t len)
{
    for (const char *p = buf; (p = rr_memmem(p, len - (size_t)(p - buf), "\\u", 2)) != NULL; p += 2) {
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

/* Whether these bytes of a config.json (a read, after the MARKER_KEEP
 * bytes kept from the one before) may ask for a GPU. */
static inline int config_bytes_may_ask(const char *buf, size_t have)
{
    for (size_t m = 0; m < sizeof(MARKERS) / sizeof(MARKERS[0]); m++)
        if (rr_memmem(buf, have, MARKERS[m], rr_strlen(MARKERS[m])))
            return 1;
    return escaped_name(buf, have);
}

#define CONFIG_BUF (MARKER_KEEP + CONFIG_CHUNK)
#define RR_EINTR 4 /* EINTR's number on Linux, on every architecture */

/* The rule over the whole of an open config.json, read through `read_fn`
 * (bytes read, 0 at the end, or -errno) into `buf`, the caller's
 * CONFIG_BUF bytes; a marker or escape may straddle two reads. */
static inline enum config_kind scan_config_reads(int fd, char *buf, long (*read_fn)(int, char *, size_t))
{
    size_t keep = 0, total = 0;
    for (;;) {
        long n = read_fn(fd, buf + keep, CONFIG_CHUNK);
        if (n == -RR_EINTR)
            continue;
        if (n < 0)
            return CONFIG_UNREADABLE;
        if (n == 0)
            return CONFIG_PLAIN;
        size_t have = keep + (size_t)n;
        if (config_bytes_may_ask(buf, have))
            return CONFIG_MAY_ASK;
        total += (size_t)n;
        if (total > CONFIG_MAX) /* it grew past what was checked: cgpud decides */
            return CONFIG_MAY_ASK;
        keep = have < MARKER_KEEP ? have : MARKER_KEEP;
        for (size_t i = 0; i < keep; i++) /* forward: the source lies after the target */
            buf[i] = buf[have - keep + i];
    }
}

/* An id cgpu-runtime sends to cgpud: 1 to CGPU_CONTAINER_ID_MAX printable
 * ASCII characters, no space. */
static inline int valid_container_id(const char *id)
{
    size_t n = 0;
    for (; id[n]; n++)
        if (id[n] <= ' ' || id[n] > '~')
            return 0;
    return n > 0 && n <= CGPU_CONTAINER_ID_MAX;
}

/* "prepare <id><flags>\n<bundle>" (relay_wire.h) into buf, NUL-ended;
 * flags: "", " " CGPU_RELAY_SHIM_BINDS or " " CGPU_RELAY_SHIM_BINDS " "
 * CGPU_RELAY_SPEC_FD. The front sends it before it execs the shim proper,
 * which sends it itself when the front did not; both build it here, so it
 * is the same bytes. Its length, or -1 if it does not fit. */
static inline long prepare_request(char *buf, size_t size, const char *id, const char *bundle, const char *flags)
{
    const char *parts[] = {"prepare ", id, flags, "\n", bundle};
    size_t o = 0;
    for (size_t k = 0; k < sizeof(parts) / sizeof(parts[0]); k++)
        for (const char *c = parts[k]; *c; c++) {
            if (o + 1 >= size)
                return -1;
            buf[o++] = *c;
        }
    buf[o] = '\0';
    return (long)o;
}

/* Whether the real runtime reads config.json as a stream, so the shim may
 * start `create` before cgpud has edited the bundle, with a FIFO at
 * config.json for it to wait on (cgpu_runtime.c, create_streamed): runc
 * does (a JSON decoder over the opened file, read to its end). Other
 * runtimes are given the finished file, as before; the front and the shim
 * proper decide alike from this. */
static inline int runtime_streams_spec(const char *runtime)
{
    const char *base = runtime;
    for (const char *c = runtime; *c; c++)
        if (*c == '/')
            base = c + 1;
    return rr_streq(base, "runc");
}

#endif
