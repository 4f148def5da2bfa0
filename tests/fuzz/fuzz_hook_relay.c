/* libFuzzer target: cgpu-hook end to end (csrc/hook/cgpu_hook.c and
 * relay.c): arguments and the container state on stdin from the input, a
 * real unix socket server thread playing cgpud. Whatever the input, the
 * request that reaches cgpud is "hook <letters> <instance id>\n" followed by
 * stdin byte for byte, and the hook says yes only when cgpud said ok.
 * Input: [argv length: 2][NUL-separated args][answer choice][stdin].
 * An argument "@S" stands for the server's socket path; the relay can reach
 * no other socket (connect is routed through guarded_connect), so a fuzz
 * input never talks to a cgpud running on this machine. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "fuzz_input.h"

static jmp_buf g_exit_jump;
static int g_exit_code;
static char g_socket[108];

/* usage_error() exits; the harness takes the exit back instead. */
static _Noreturn void fuzz_exit(int code)
{
    g_exit_code = code;
    longjmp(g_exit_jump, 1);
}

static int guarded_connect(int fd, const struct sockaddr *addr, socklen_t len)
{
    const struct sockaddr_un *un = (const struct sockaddr_un *)addr;
    if (strcmp(un->sun_path, g_socket) != 0) {
        errno = ENOENT;
        return -1;
    }
    return connect(fd, addr, len);
}

#define exit(code) fuzz_exit(code)
#define main cgpu_hook_main
#include "hook/cgpu_hook.c"
#undef main
#undef exit
#define connect guarded_connect
#include "hook/relay.c"
#undef connect

static const char *const ANSWERS[] = {"ok\n", "ok bound cgpu-0000aaaa\n", "error instance is released\n", "",
                                      "error\n", "okay\n", "ok"};
#define N_ANSWERS (sizeof(ANSWERS) / sizeof(ANSWERS[0]))

/* One request at a time: the harness waits for the hook, the hook for us. */
static struct {
    pthread_mutex_t lock;
    int served;
    size_t len;
    unsigned answer;
    char buf[CGPU_RELAY_MAX_REQUEST + 64];
} g_srv = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void *serve(void *arg)
{
    int lfd = *(int *)arg;
    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0)
            continue;
        pthread_mutex_lock(&g_srv.lock);
        size_t n = 0;
        for (;;) {
            ssize_t k = recv(c, g_srv.buf + n, sizeof(g_srv.buf) - n, 0);
            if (k <= 0)
                break;
            n += (size_t)k;
        }
        g_srv.len = n;
        g_srv.served++;
        const char *a = ANSWERS[g_srv.answer];
        send(c, a, strlen(a), MSG_NOSIGNAL);
        pthread_mutex_unlock(&g_srv.lock);
        close(c);
    }
    return NULL;
}

static void remove_socket(void)
{
    unlink(g_socket);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    atexit(remove_socket);
    snprintf(g_socket, sizeof(g_socket), "/tmp/cgpu-fuzz-hook-%d.sock", (int)getpid());
    unlink(g_socket);
    static int lfd;
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strcpy(addr.sun_path, g_socket);
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&addr, sizeof(addr)) == 0 && listen(lfd, 4) == 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, serve, &lfd) == 0);
    return 0;
}

static bool letters(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= 'a' && s[i] <= 'z')))
            return false;
    return n > 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_reader r = {data, size};
    const uint8_t *blob;
    size_t blob_len = fuzz_take(&r, (size_t)fuzz_uint(&r, 2), &blob);
    char *copy = malloc(blob_len + 1);
    CHECK(copy);
    memcpy(copy, blob, blob_len);
    copy[blob_len] = '\0';
    char *argv[40] = {"cgpu-hook"};
    int argc = 1;
    for (size_t i = 0; i < blob_len && argc < 38; argc++) {
        argv[argc] = strcmp(copy + i, "@S") == 0 ? g_socket : copy + i;
        i += strlen(copy + i) + 1;
    }
    argv[argc] = NULL;
    unsigned answer = (unsigned)fuzz_uint(&r, 1) % N_ANSWERS;
    const uint8_t *state;
    size_t state_len = fuzz_take(&r, r.left, &state);

    int in = memfd_create("cgpu-fuzz-state", MFD_CLOEXEC), saved = dup(STDIN_FILENO);
    CHECK(in >= 0 && saved >= 0 && write(in, state, state_len) == (ssize_t)state_len);
    CHECK(lseek(in, 0, SEEK_SET) == 0 && dup2(in, STDIN_FILENO) == STDIN_FILENO);
    close(in);

    pthread_mutex_lock(&g_srv.lock);
    g_srv.answer = answer;
    int served = g_srv.served;
    pthread_mutex_unlock(&g_srv.lock);

    int rc;
    if (setjmp(g_exit_jump) == 0)
        rc = cgpu_hook_main(argc, argv);
    else
        rc = g_exit_code;
    CHECK(dup2(saved, STDIN_FILENO) == STDIN_FILENO);
    close(saved);

    pthread_mutex_lock(&g_srv.lock);
    bool asked = g_srv.served != served;
    if (asked) {
        /* "hook STAGE INSTANCE\n" then the state, exactly as read. */
        char *nl = memchr(g_srv.buf, '\n', g_srv.len);
        CHECK(nl && memcmp(g_srv.buf, "hook ", 5) == 0);
        char *stage = g_srv.buf + 5, *sp = memchr(stage, ' ', (size_t)(nl - stage));
        CHECK(sp && letters(stage, (size_t)(sp - stage)) && sp - stage <= STAGE_MAX);
        CHECK(nl - (sp + 1) >= 1 && nl - (sp + 1) <= INSTANCE_MAX);
        for (char *c = sp + 1; c < nl; c++)
            CHECK(strchr("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-", *c) && *c);
        size_t body = g_srv.len - (size_t)(nl + 1 - g_srv.buf);
        CHECK(body == state_len && memcmp(nl + 1, state, state_len) == 0);
    }
    pthread_mutex_unlock(&g_srv.lock);
    bool said_ok = answer < N_ANSWERS && strncmp(ANSWERS[answer], "ok", 2) == 0 &&
                   (ANSWERS[answer][2] == '\n' || ANSWERS[answer][2] == ' ');
    bool version = false;
    for (int i = 1; i < argc; i++)
        version |= strcmp(argv[i], "--version") == 0;
    if (rc == 0)
        CHECK(asked ? said_ok : version);
    else
        CHECK(!asked || !said_ok);
    free(copy);
    return 0;
}
