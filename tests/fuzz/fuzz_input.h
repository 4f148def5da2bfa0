/* Helpers shared by the libFuzzer targets: reading a fuzz input as a stream
 * of fields, and failing loudly on a broken invariant.
 * Ownership: a reader borrows the input for one call; nothing is allocated.
 * Thread-safety: none needed, libFuzzer calls one input at a time. */
#ifndef CGPU_FUZZ_INPUT_H
#define CGPU_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An invariant the code under test broke: libFuzzer records the input. */
#define CHECK(cond)                                                                                           \
    do {                                                                                                      \
        if (!(cond)) {                                                                                        \
            fprintf(stderr, "%s:%d: invariant broken: %s\n", __FILE__, __LINE__, #cond);                      \
            abort();                                                                                          \
        }                                                                                                     \
    } while (0)

struct fuzz_reader {
    const uint8_t *p;
    size_t left;
};

/* Past the end every field reads as zero: a short input is still an input. */
static inline uint64_t fuzz_uint(struct fuzz_reader *r, unsigned bytes)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < bytes; i++) {
        v <<= 8;
        if (r->left) {
            v |= *r->p++;
            r->left--;
        }
    }
    return v;
}

static inline size_t fuzz_take(struct fuzz_reader *r, size_t n, const uint8_t **out)
{
    if (n > r->left)
        n = r->left;
    *out = r->p;
    r->p += n;
    r->left -= n;
    return n;
}

/* Tenant scribbles: [count] then per patch [offset (off_bytes)][len][bytes],
 * each landing inside buf (offset taken modulo its size). */
static inline void fuzz_patch(struct fuzz_reader *r, uint8_t *buf, size_t size, unsigned off_bytes)
{
    unsigned count = (unsigned)fuzz_uint(r, 1) % 16;
    for (unsigned i = 0; i < count && size > 0; i++) {
        size_t off = (size_t)fuzz_uint(r, off_bytes) % size;
        const uint8_t *src;
        size_t n = fuzz_take(r, (size_t)fuzz_uint(r, 1), &src);
        if (n > size - off)
            n = size - off;
        memcpy(buf + off, src, n);
    }
}

#endif
