/* libFuzzer target: cgpu-hook end to end (csrc/hook/cgpu_hook.c, its own
 * relay client here on libc): arguments and the container state on stdin
 * from the input, a real unix socket server thread playing cgpud. Whatever
 * the input, the request that reaches cgpud is "hook <letters> <instance
 * id>\n" followed by stdin byte for byte, and the hook says yes only when
 * cgpud said ok.
 * Input: [argv length: 2][NUL-separated args][answer choice][stdin].
 * An argument "@S" stands for the server's socket path (fuzz_server.h: the
 * relay can reach no other socket). */
#define _GNU_SOURCE
#include <stdbool.h>
#include <stdlib.h>
#include <sys/mman.h>

/* usage_error() exits; the harness takes the exit back instead. */
#define FUZZ_RELAY_SOURCE "hook/cgpu_hook.c"
#define FUZZ_RELAY_MAIN cgpu_hook_main
#define FUZZ_RELAY_OWN_CLIENT
#include "fuzz_relay_main.h"

static const char *const ANSWERS[] = {"ok\n", "ok bound cgpu-0000aaaa\n", "error instance is released\n", "",
                                      "error\n", "okay\n", "ok"};
#define N_ANSWERS (sizeof(ANSWERS) / sizeof(ANSWERS[0]))

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_server_start("hook");
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
        argv[argc] = strcmp(copy + i, "@S") == 0 ? fuzz_srv.path : copy + i;
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

    int served = fuzz_server_arm(ANSWERS[answer]);

    int rc;
    if (setjmp(g_exit_jump) == 0)
        rc = cgpu_hook_main(argc, argv);
    else
        rc = g_exit_code;
    CHECK(dup2(saved, STDIN_FILENO) == STDIN_FILENO);
    close(saved);

    pthread_mutex_lock(&fuzz_srv.lock);
    bool asked = fuzz_srv.served != served;
    if (asked) {
        /* "hook STAGE INSTANCE\n" then the state, exactly as read. */
        char *nl = memchr(fuzz_srv.buf, '\n', fuzz_srv.len);
        CHECK(nl && memcmp(fuzz_srv.buf, "hook ", 5) == 0);
        char *stage = fuzz_srv.buf + 5, *sp = memchr(stage, ' ', (size_t)(nl - stage));
        CHECK(sp && letters(stage, (size_t)(sp - stage)) && sp - stage <= STAGE_MAX);
        CHECK(nl - (sp + 1) >= 1 && nl - (sp + 1) <= INSTANCE_MAX);
        for (char *c = sp + 1; c < nl; c++)
            CHECK(strchr("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-", *c) && *c);
        size_t body = fuzz_srv.len - (size_t)(nl + 1 - fuzz_srv.buf);
        CHECK(body == state_len && memcmp(nl + 1, state, state_len) == 0);
    }
    pthread_mutex_unlock(&fuzz_srv.lock);
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
