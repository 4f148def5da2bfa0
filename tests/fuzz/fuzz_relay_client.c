/* libFuzzer target: the relay client's side of the wire (csrc/hook/relay.c).
 * cgpud's answer is the fuzz input, sent on a real socket pair into
 * exchange(), which sends a request and reads the answer line back; the
 * message the relay prints must be one bounded line of printable text, and
 * only "ok" or "ok <text>" on the first line may count as a yes.
 * Input: [msg size: 2][flags][answer bytes]. */
#define _GNU_SOURCE
#include "hook/relay.c"

#include <stdbool.h>
#include <stdlib.h>

#include "fuzz_input.h"

static const char REQUEST[] = "hook createRuntime cgpu-0000aaaa\n{\"id\":\"c1\",\"pid\":1}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_reader r = {data, size};
    size_t msg_size = 1 + (size_t)fuzz_uint(&r, 2) % CGPU_RELAY_MSG_MAX;
    unsigned flags = (unsigned)fuzz_uint(&r, 1);
    const uint8_t *answer;
    size_t len = fuzz_take(&r, 1 << 16, &answer);

    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    CHECK(send_all(sv[1], (const char *)answer, len) == 0);
    if (flags & 1)
        close(sv[1]); /* cgpud answered and hung up before reading: the send fails */
    else
        shutdown(sv[1], SHUT_WR);
    char *msg = malloc(msg_size);
    CHECK(msg);
    int gone = 0;
    int rc = exchange(sv[0], "/run/cgpud/relay.sock", REQUEST, sizeof(REQUEST) - 1, msg, msg_size, &gone);
    close(sv[0]);
    if (!(flags & 1))
        close(sv[1]);

    CHECK(rc == 0 || rc == -1);
    /* Sent again only when cgpud said nothing at all. */
    CHECK(!gone || (rc == -1 && len == 0));
    size_t shown = strnlen(msg, msg_size);
    CHECK(shown < msg_size);
    for (size_t i = 0; i < shown; i++)
        CHECK((unsigned char)msg[i] >= 0x20 && (unsigned char)msg[i] != 0x7f);

    /* The first line, as far as the client reads (CGPU_RELAY_MSG_MAX). */
    const uint8_t *nl = memchr(answer, '\n', len < CGPU_RELAY_MSG_MAX ? len : CGPU_RELAY_MSG_MAX);
    size_t line = nl ? (size_t)(nl - answer) : 0;
    bool yes = nl && line >= 2 && memcmp(answer, "ok", 2) == 0 && (line == 2 || answer[2] == ' ');
    CHECK((rc == 0) == yes);
    if (yes) {
        size_t text = line > 3 ? line - 3 : 0, want = text < msg_size - 1 ? text : msg_size - 1;
        CHECK(shown == want);
        for (size_t i = 0; i < want; i++)
            CHECK(msg[i] == (answer[3 + i] < 0x20 || answer[3 + i] == 0x7f ? ' ' : (char)answer[3 + i]));
    }
    free(msg);
    return 0;
}
