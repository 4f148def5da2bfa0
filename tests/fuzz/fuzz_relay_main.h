/* A relay's C source compiled into a fuzz harness: its main() renamed to
 * FUZZ_RELAY_MAIN, its exit() brought back to the harness through
 * g_exit_jump (set it with setjmp before each call that may exit), and its
 * connect() routed to fuzz_server.h's socket only. Define FUZZ_RELAY_SOURCE
 * and FUZZ_RELAY_MAIN (and FUZZ_RELAY_OWN_CLIENT for a source that does not
 * use relay.c), then include this once. */
#ifndef CGPU_FUZZ_RELAY_MAIN_H
#define CGPU_FUZZ_RELAY_MAIN_H

#include <setjmp.h>

#include "fuzz_server.h"

static jmp_buf g_exit_jump;
static int g_exit_code;

static _Noreturn void fuzz_exit(int code)
{
    g_exit_code = code;
    longjmp(g_exit_jump, 1);
}

/* connect() is routed before the relay's source too: cgpu-hook's own
 * client (mini_sys.h's libc calls) connects from there. The system headers
 * were included above, so their declaration keeps its name. */
#define connect fuzz_guarded_connect
#define exit(code) fuzz_exit(code)
#define main FUZZ_RELAY_MAIN
#include FUZZ_RELAY_SOURCE
#undef main
#undef exit
#if !defined(FUZZ_RELAY_OWN_CLIENT) /* cgpu-hook carries its own client */
#include "hook/relay.c"
#endif
#undef connect

#endif
