/* Client side of the relay protocol between the container start path
 * (cgpu-runtime, cgpu-hook) and cgpud; the protocol is described in
 * cgpu/relay_wire.h. The policy lives in cgpud; this side only carries bytes.
 * Ownership: callers own every buffer they pass, nothing is allocated;
 * thread-safety: no shared state, any thread may call (the relays use one). */
#ifndef CGPU_HOOK_RELAY_H
#define CGPU_HOOK_RELAY_H

#include <stddef.h>

#include "cgpu/relay_wire.h"

/* The package's version, from pyproject.toml: build_native.py passes it. */
#ifndef CGPU_VERSION
#error "CGPU_VERSION is not defined: build the relays with csrc/build_native.py"
#endif

/* Sends `request` (first line, "\n", body) on a fresh connection to the
 * unix socket at `socket_path`, half-closes, and reads the answer line.
 * While cgpud is down (socket missing or refusing, or gone before answering)
 * it tries again with backoff (50 ms up to 500 ms) for CGPU_RELAY_WAIT_S, or
 * less if the env variable CGPU_RELAY_WAIT_MS asks, saying so once on stderr
 * as `prog`. Returns 0 if cgpud answered "ok" (msg = the text after "ok ",
 * maybe empty), -1 otherwise (msg = cgpud's error message, or why cgpud
 * could not be asked). msg is always one NUL-terminated line of printable
 * text; callers give CGPU_RELAY_MSG_MAX bytes for it. */
int cgpu_relay_call(const char *prog, const char *socket_path, const char *request, size_t len, char *msg,
                    size_t msg_size);

/* The same for a request already sent on fd, a connection to `path`:
 * reads the answer and closes fd; if cgpud went away without answering,
 * asks again as cgpu_relay_call does. `request` is what was sent. */
int cgpu_relay_finish(const char *prog, int fd, const char *path, const char *request, size_t len, char *msg,
                      size_t msg_size);

/* Sends `request` with the descriptor `pass_fd` (SCM_RIGHTS, on its first
 * byte) on a fresh connection to `socket_path` and half-closes: the
 * connection, for cgpu_relay_answer. -1 if that failed (msg says why; *down
 * set when cgpud is not running: socket missing or refusing). No retry:
 * the caller decides what a missing cgpud means. */
int cgpu_relay_send_fd(const char *socket_path, const char *request, size_t len, int pass_fd, char *msg,
                       size_t msg_size, int *down);

/* The answer on a connection from cgpu_relay_send_fd, as cgpu_relay_call
 * returns it; closes fd. *gone: cgpud went away without a byte of answer. */
int cgpu_relay_answer(int fd, const char *socket_path, char *msg, size_t msg_size, int *gone);

/* "<prog>: <msg>" on stderr. */
void cgpu_relay_report(const char *prog, const char *msg);

#endif
