/* cgpu-hook: the OCI hook relay. runc runs it with the container state on
 * stdin; it hands the state to cgpud and fails the container's start if cgpud
 * says no. The hook entry cgpud writes names the stage and the instance, so
 * nothing here depends on the environment, the cwd or the container rootfs. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cgpu/region.h"
#include "relay.h"

#define PROG "cgpu-hook"
#define USAGE "usage: cgpu-hook [--socket PATH] --instance ID STAGE"
#define INSTANCE_MAX (CGPU_INSTANCE_ID_LEN - 1) /* the longest id a region holds */
#define STAGE_MAX 64

__attribute__((format(printf, 1, 2))) static _Noreturn void usage_error(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, PROG ": %s\n" USAGE "\n", msg);
    exit(2);
}

static int is_alpha(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

static int valid_stage(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!is_alpha(s[n]))
            return 0;
    return n > 0 && n <= STAGE_MAX;
}

static int valid_instance(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!is_alpha(s[n]) && !(s[n] >= '0' && s[n] <= '9') && !strchr("_.-", s[n]))
            return 0;
    return n > 0 && n <= INSTANCE_MAX;
}

/* Matches "--name VALUE" and "--name=VALUE"; advances *i past the value. */
static int option(char **argv, int argc, int *i, const char *name, const char **value)
{
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0 || (a[n] != '\0' && a[n] != '='))
        return 0;
    if (a[n] == '=')
        *value = a + n + 1;
    else if (*i + 1 < argc)
        *value = argv[++*i];
    else
        usage_error("%s needs a value", name);
    return 1;
}

int main(int argc, char **argv)
{
    /* The request is built in place: the state is read straight after its line. */
    static char request[CGPU_RELAY_MAX_REQUEST + 1];
    const char *socket = CGPU_RELAY_DEFAULT_SOCKET, *instance = NULL;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (strcmp(argv[i], "--version") == 0) {
            puts(PROG " " CGPU_VERSION);
            return 0;
        }
        if (!option(argv, argc, &i, "--socket", &socket) && !option(argv, argc, &i, "--instance", &instance))
            usage_error("unknown option %s", argv[i]);
    }
    if (i == argc)
        usage_error("missing STAGE (the OCI hook stage, e.g. createRuntime)");
    if (i + 1 < argc)
        usage_error("unexpected argument %s after STAGE %s", argv[i + 1], argv[i]);
    const char *stage = argv[i];
    if (!valid_stage(stage))
        usage_error("STAGE must be 1-%d letters, got \"%s\"", STAGE_MAX, stage);
    if (!instance)
        usage_error("missing --instance ID (the hook entry must name its cgpu instance)");
    if (!valid_instance(instance))
        usage_error("--instance must be 1-%d characters of A-Z a-z 0-9 _ . -, got \"%s\"", INSTANCE_MAX,
                    instance);
    if (socket[0] != '/')
        usage_error("--socket must be an absolute path, got \"%s\"", socket);

    size_t head = (size_t)snprintf(request, sizeof(request), "hook %s %s\n", stage, instance);
    size_t cap = CGPU_RELAY_MAX_REQUEST - head, n = 0;
    char *state = request + head;
    while (n <= cap) {
        ssize_t r = read(STDIN_FILENO, state + n, cap + 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            fprintf(stderr, PROG ": cannot read the container state from stdin: %s\n", strerror(errno));
            return 1;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    size_t lead = 0;
    while (lead < n && strchr(" \t\r\n", state[lead]) && state[lead] != '\0')
        lead++;
    if (lead >= n || state[lead] != '{') {
        fprintf(stderr, PROG ": expected the OCI container state (a JSON object) on stdin\n");
        return 1;
    }
    if (n > cap) {
        fprintf(stderr, PROG ": container state larger than %zu bytes\n", cap);
        return 1;
    }
    char msg[CGPU_RELAY_MSG_MAX];
    if (cgpu_relay_call(PROG, socket, request, head + n, msg, sizeof(msg)) != 0) {
        cgpu_relay_report(PROG, msg);
        return 1;
    }
    return 0;
}
