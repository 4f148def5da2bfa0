/* Opening and mapping one file of an instance region: libcgpu.so maps its
 * limits, usage and grants files here at load, the scheduler engine a
 * tenant's grants and usage files at attach. Not for hot paths: it opens,
 * maps and formats messages.
 *
 * Ownership: the caller owns what it gets, the mapping and the descriptor.
 * Thread-safety: no state; safe from any thread. */
#ifndef CGPU_REGION_FILE_H
#define CGPU_REGION_FILE_H

#include <stddef.h>

/* The longest path cgpu_region_file_map takes, NUL included. */
#define CGPU_REGION_PATH_MAX 4096

struct cgpu_region_file {
    void *addr;
    size_t size; /* bytes mapped */
    int fd;      /* still open: the ledger and gate locks live on it */
};

/* Opens dir/name with `flags` (O_CLOEXEC added) and maps it shared,
 * writable too when flags say O_RDWR. size 0 maps the whole file, which
 * must not be empty; any other size maps that many bytes of a file at least
 * that long. 0, or a negative errno with a message in err (-EINVAL for a
 * file too short) and nothing left open. */
int cgpu_region_file_map(const char *dir, const char *name, int flags, size_t size, struct cgpu_region_file *f,
                         char *err, size_t errlen);

#endif
