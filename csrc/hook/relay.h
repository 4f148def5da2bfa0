/* Client side of the relay protocol between the container start path
 * (cgpu-runtime, cgpu-hook) and cgpud: one request per connection, one
 * answer line back. The policy lives in cgpud; this side only carries bytes.
 * Ownership: callers own every buffer they pass, nothing is allocated;
 * thread-safety: no shared state, any thread may call (the relays use one). */
#ifndef CGPU_HOOK_RELAY_H
#define CGPU_HOOK_RELAY_H

#include <stddef.h>

#define CGPU_VERSION "0.1.0"
#define CGPU_RELAY_DEFAULT_SOCKET "/run/cgpud/relay.sock"
#define CGPU_RELAY_MAX_REQUEST ((size_t)1 << 20)
#define CGPU_RELAY_TIMEOUT_S 30
/* Longest answer line accepted; also the size callers give for `msg`. */
#define CGPU_RELAY_MSG_MAX 4096

/* Sends `request` (first line, "\n", body) on a fresh connection to the
 * unix socket at `socket_path`, half-closes, and reads the answer line.
 * Returns 0 if cgpud answered "ok" (msg = the text after "ok ", maybe empty),
 * -1 otherwise (msg = cgpud's error message, or why cgpud could not be asked).
 * msg is always one NUL-terminated line of printable text. */
int cgpu_relay_call(const char *socket_path, const char *request, size_t len, char *msg, size_t msg_size);

/* "<prog>: <msg>" on stderr. */
void cgpu_relay_report(const char *prog, const char *msg);

#endif
