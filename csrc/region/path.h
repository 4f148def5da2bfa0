/* Building a region file's path, shared by libcgpu.so and the scheduler
 * engine. Header-only: the cffi region module parses the region headers as its cdef. */
#ifndef CGPU_REGION_PATH_H
#define CGPU_REGION_PATH_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

/* Writes "dir/name" into out; false, and out not to be used, if it does not
 * fit: a truncated path would name another file. */
static inline bool cgpu_join_path(char *out, size_t len, const char *dir, const char *name)
{
    size_t d = strlen(dir), n = strlen(name);
    if (d + 1 + n >= len)
        return false;
    memcpy(out, dir, d);
    out[d] = '/';
    memcpy(out + d + 1, name, n + 1);
    return true;
}

#endif
