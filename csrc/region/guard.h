/* A SIGBUS guard for mappings of files a tenant can truncate under us.
 *
 * A registered mapping whose file shrinks does not kill the process: the
 * SIGBUS handler maps anonymous zero pages over the whole registered range
 * and marks it damaged, and the faulting access completes on zeros. A fault
 * anywhere else goes to the handler installed before ours (Python's
 * faulthandler, another module's copy of this guard), or kills as SIGBUS
 * would by default.
 *
 * Each module that maps tenant files compiles its own copy (hidden symbols,
 * its own table and handler); the copies chain, so they compose.
 *
 * Ownership: the caller owns its mappings; it unregisters one before
 * unmapping it. Thread-safety: every function may be called from any thread;
 * the table is fixed-size atomics, read by the handler without locks. */
#ifndef CGPU_GUARD_H
#define CGPU_GUARD_H

#include <stddef.h>

#define CGPU_GUARD_SLOTS 1024

/* Installs the handler once per module; 0, or -errno from sigaction. */
int cgpu_guard_install(void);
/* A handle for the range, or -1 when the table is full or the range empty.
 * Installs the handler if needed. */
int cgpu_guard_register(void *addr, size_t len);
void cgpu_guard_unregister(int handle);
/* 1 once the handler replaced the range's pages with zeros, else 0. */
int cgpu_guard_damaged(int handle);

#endif
