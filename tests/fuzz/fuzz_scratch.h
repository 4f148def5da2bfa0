/* A scratch directory a libFuzzer target keeps for its whole run: made in
 * LLVMFuzzerInitialize, removed at exit with the files it names.
 * Ownership: the header's own static state, one per target binary.
 * Thread-safety: none needed, it is made before the first input. */
#ifndef CGPU_FUZZ_SCRATCH_H
#define CGPU_FUZZ_SCRATCH_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz_input.h"

static struct {
    char dir[64];
    const char *const *files; /* NULL-ended names inside dir */
} fuzz_scratch;

static void fuzz_scratch_remove(void)
{
    char path[128];
    for (const char *const *f = fuzz_scratch.files; *f; f++) {
        snprintf(path, sizeof(path), "%s/%s", fuzz_scratch.dir, *f);
        unlink(path);
    }
    rmdir(fuzz_scratch.dir);
}

/* Makes /tmp/cgpu-fuzz-<tag>-XXXXXX; files: what the target may leave in
 * it, NULL-ended. */
static inline char *fuzz_scratch_make(const char *tag, const char *const *files)
{
    snprintf(fuzz_scratch.dir, sizeof(fuzz_scratch.dir), "/tmp/cgpu-fuzz-%s-XXXXXX", tag);
    CHECK(mkdtemp(fuzz_scratch.dir) != NULL);
    fuzz_scratch.files = files;
    atexit(fuzz_scratch_remove);
    return fuzz_scratch.dir;
}

#endif
