/* libFuzzer target: the runtime shim's own parsing (csrc/hook/cgpu_runtime.c)
 * - the config.json scanner that decides, from raw bytes, whether a bundle
 *   may ask for a GPU: it must say so exactly when a marker or a \uXXXX
 *   escape of a name character is anywhere in the file, also across the
 *   64 KiB read boundary (a miss would start a GPU container without limits);
 * - runc's argument parsing (global flags, create/run flags, the id);
 * - the JSON escaping of the error line written into runc's log;
 * - prepare(): the request it builds for cgpud (fuzz_server.h plays cgpud)
 *   and whether the container may start after cgpud's answer.
 * Input: [part][part's fields]. The shim's main() is renamed away, and its
 * exit() comes back to the harness. */
#define _GNU_SOURCE
#include <stdbool.h>
#include <stdlib.h>

#define FUZZ_RELAY_SOURCE "hook/cgpu_runtime.c"
#define FUZZ_RELAY_MAIN cgpu_runtime_main
#include "fuzz_relay_main.h"
#include "fuzz_scratch.h"

enum { PART_SCAN, PART_ARGS, PART_ESCAPE, PART_PREPARE, PART_COUNT };

static char *g_bundle;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    static const char *const files[] = {"config.json", NULL};
    g_bundle = fuzz_scratch_make("shim", files);
    fuzz_server_start("shim");
    return 0;
}

/* The rule read_config() implements, over the whole file at once. */
static bool may_ask(const uint8_t *p, size_t n)
{
    for (size_t m = 0; m < sizeof(MARKERS) / sizeof(MARKERS[0]); m++)
        if (memmem(p, n, MARKERS[m], strlen(MARKERS[m])))
            return true;
    for (size_t i = 0; i + 6 <= n; i++) {
        if (p[i] != '\\' || p[i + 1] != 'u')
            continue;
        int code = 0;
        for (size_t k = 2; k < 6 && code >= 0; k++)
            code = hexval((char)p[i + k]) < 0 ? -1 : code * 16 + hexval((char)p[i + k]);
        if ((code >= '0' && code <= '9') || (code >= 'A' && code <= 'Z') || (code >= 'a' && code <= 'z') ||
            code == '_' || code == '/')
            return true;
    }
    return false;
}

/* [pad: 1][config bytes]: an odd pad byte puts the bytes within 128 of the
 * end of the first read (CONFIG_CHUNK), where markers straddle two reads. */
static void fuzz_scan(struct fuzz_reader *r)
{
    unsigned pad_sel = (unsigned)fuzz_uint(r, 1);
    size_t pad = pad_sel & 1 ? CONFIG_CHUNK - 128 + (pad_sel >> 1) : 0;
    const uint8_t *body;
    size_t n = fuzz_take(r, r->left, &body);
    uint8_t *file = malloc(pad + n + 1);
    CHECK(file);
    memset(file, 'x', pad); /* 'x' is in no marker: the pad cannot complete one */
    memcpy(file + pad, body, n);
    char path[128];
    snprintf(path, sizeof(path), "%s/config.json", g_bundle);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0 && write(fd, file, pad + n) == (ssize_t)(pad + n));
    close(fd);
    enum config_kind kind = read_config(g_bundle);
    CHECK(kind == (may_ask(file, pad + n) ? CONFIG_MAY_ASK : CONFIG_PLAIN));
    free(file);
}

static bool within(const char *p, char **argv, int argc)
{
    for (int i = 0; i < argc; i++)
        if (p >= argv[i] && p <= argv[i] + strlen(argv[i]))
            return true;
    return false;
}

/* runc's argv from the rest of the input: arguments separated by NUL
 * bytes after argv[0], an argument "@B" standing for the bundle made here.
 * The arguments point into copy: free it when done. */
struct fuzz_argv {
    char *copy;
    char *argv[66];
    int argc;
};

static void take_argv(struct fuzz_reader *r, struct fuzz_argv *a)
{
    const uint8_t *blob;
    size_t n = fuzz_take(r, r->left, &blob);
    a->copy = malloc(n + 1);
    CHECK(a->copy);
    memcpy(a->copy, blob, n);
    a->copy[n] = '\0';
    a->argv[0] = "cgpu-runtime";
    a->argc = 1;
    for (size_t i = 0; i < n && a->argc < 64; a->argc++) {
        char *arg = a->copy + i;
        a->argv[a->argc] = strcmp(arg, "@B") == 0 ? g_bundle : arg;
        i += strlen(arg) + 1;
    }
    a->argv[a->argc] = NULL;
    g_opts = (struct runc_globals){0};
}

static void fuzz_args(struct fuzz_reader *r)
{
    struct fuzz_argv a;
    take_argv(r, &a);
    char **argv = a.argv;
    int argc = a.argc;
    int cmd = parse_globals(argv);
    CHECK(cmd >= 1 && cmd <= argc);
    CHECK(!g_opts.log || within(g_opts.log, argv, argc));
    CHECK(!g_opts.log_format || within(g_opts.log_format, argv, argc));
    if (argv[cmd] && (strcmp(argv[cmd], "create") == 0 || strcmp(argv[cmd], "run") == 0)) {
        const char *bundle = ".", *id = NULL, *pid_file = NULL;
        parse_create(argv + cmd + 1, &bundle, &id, &pid_file);
        CHECK(!pid_file || within(pid_file, argv + cmd + 1, argc - cmd - 1));
        CHECK(strcmp(bundle, ".") == 0 || within(bundle, argv + cmd + 1, argc - cmd - 1));
        CHECK(!id || within(id, argv + cmd + 1, argc - cmd - 1));
        /* Only a runtime whose last path component is exactly "runc" gets the spec streamed. */
        const char *base = strrchr(bundle, '/') ? strrchr(bundle, '/') + 1 : bundle;
        CHECK(runtime_streams_spec(bundle) == (strcmp(base, "runc") == 0));
        if (id && valid_container_id(id)) {
            for (const char *c = id; *c; c++)
                CHECK(*c > ' ' && *c <= '~');
            /* The request the front and the shim both build: whole, or -1 when it does not fit. */
            static char request[CGPU_CONTAINER_ID_MAX + 64];
            size_t size = 1 + strlen(bundle) % sizeof(request);
            const char *flags = !pid_file     ? ""
                                : strlen(id) % 2 ? " " CGPU_RELAY_SHIM_BINDS
                                                 : " " CGPU_RELAY_SHIM_BINDS " " CGPU_RELAY_SPEC_FD;
            long len = prepare_request(request, size, id, bundle, flags);
            size_t want = strlen("prepare ") + strlen(id) + strlen(flags) + 1 + strlen(bundle);
            CHECK(len == (want < size ? (long)want : -1));
            CHECK(len < 0 || (strncmp(request, "prepare ", 8) == 0 && strlen(request) == want &&
                              strcmp(request + want - strlen(bundle), bundle) == 0 && request[want - strlen(bundle) - 1] == '\n'));
        }
    }
    free(a.copy);
}

/* [dst size: 2][text]: the escaped text is a prefix of the full escape,
 * cut between escapes, with no raw quote, backslash or control byte. */
static void fuzz_escape(struct fuzz_reader *r)
{
    size_t size = 1 + (size_t)fuzz_uint(r, 2) % 8192;
    const uint8_t *text;
    size_t n = fuzz_take(r, 4096, &text);
    char *src = malloc(n + 1), *dst = malloc(size), *full = malloc(6 * n + 1);
    CHECK(src && dst && full);
    memcpy(src, text, n);
    src[n] = '\0';
    size_t len = json_escape(dst, size, src), full_len = json_escape(full, 6 * n + 1, src);
    CHECK(len < size && dst[len] == '\0' && len <= full_len && memcmp(dst, full, len) == 0);
    CHECK(full_len == strlen(full) && (len == full_len || full[len] == '\\' || len + 1 >= size ||
                                       len + 6 >= size));
    for (size_t i = 0; i < full_len; i++) {
        unsigned char c = (unsigned char)full[i];
        CHECK(c >= 0x20 && c != 0x7f);
        if (c == '\\') {
            CHECK(i + 1 < full_len && strchr("\"\\u", full[i + 1]));
            i++;
        } else {
            CHECK(c != '"');
        }
    }
    free(src);
    free(dst);
    free(full);
}

static const char *const ANSWERS[] = {"ok\n", "ok instance cgpu-0000aaaa\n", "error no GPU has 17 GiB free\n", "",
                                      "bogus\n"};

static void write_config(const char *text)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/config.json", g_bundle);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0 && write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
}

/* [config][answer][NUL-separated args]; an argument "@B" is the bundle made
 * here, whose config asks for a GPU or not. */
static void fuzz_prepare(struct fuzz_reader *r)
{
    write_config(fuzz_uint(r, 1) & 1 ? "{\"process\":{\"env\":[\"ALIYUN_COM_GPU_MEM_CONTAINER=2\"]}}"
                                     : "{\"process\":{\"env\":[\"PATH=/bin\"]}}");
    const char *answer = ANSWERS[fuzz_uint(r, 1) % (sizeof(ANSWERS) / sizeof(ANSWERS[0]))];
    struct fuzz_argv a;
    take_argv(r, &a);
    char **argv = a.argv;
    int cmd = parse_globals(argv);
    g_opts.log = NULL; /* die() appends to --log: never to a path from the input */
    if (argv[cmd] && (strcmp(argv[cmd], "create") == 0 || strcmp(argv[cmd], "run") == 0)) {
        int served = fuzz_server_arm(answer);
        bool died = false;
        if (setjmp(g_exit_jump) == 0)
            prepare(argv[cmd], argv + cmd + 1, fuzz_srv.path, NULL);
        else
            died = true;
        pthread_mutex_lock(&fuzz_srv.lock);
        bool asked = fuzz_srv.served != served;
        if (asked) {
            /* "prepare <id>\n<absolute bundle>": the id is one printable word. */
            char *nl = memchr(fuzz_srv.buf, '\n', fuzz_srv.len);
            CHECK(nl && fuzz_srv.len >= 8 && memcmp(fuzz_srv.buf, "prepare ", 8) == 0);
            CHECK(nl - fuzz_srv.buf > 8 && nl - fuzz_srv.buf - 8 <= ID_MAX);
            for (char *c = fuzz_srv.buf + 8; c < nl; c++)
                CHECK(*c > ' ' && *c <= '~');
            CHECK((size_t)(nl + 1 - fuzz_srv.buf) < fuzz_srv.len && nl[1] == '/');
            CHECK(memchr(nl + 1, '\0', fuzz_srv.len - (size_t)(nl + 1 - fuzz_srv.buf)) == NULL);
        }
        pthread_mutex_unlock(&fuzz_srv.lock);
        bool ok = strncmp(answer, "ok", 2) == 0 && (answer[2] == '\n' || answer[2] == ' ');
        if (died)
            CHECK(g_exit_code == 1 && (!asked || !ok));
        else
            CHECK(!asked || ok); /* the container starts only on cgpud's ok */
    }
    free(a.copy);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_reader r = {data, size};
    switch (fuzz_uint(&r, 1) % PART_COUNT) {
    case PART_SCAN:
        fuzz_scan(&r);
        break;
    case PART_ARGS:
        fuzz_args(&r);
        break;
    case PART_PREPARE:
        fuzz_prepare(&r);
        break;
    default:
        fuzz_escape(&r);
        break;
    }
    return 0;
}
