/* What every workload tool prints the same way: the one-line failure report
 * and a JSON string. Header-only for single-file programs: define
 * CUDA_TOOL_NAME, then include this. Not thread-safe (stdio, one writer). */
#ifndef CGPU_TOOL_OUTPUT_H
#define CGPU_TOOL_OUTPUT_H

#include <stdarg.h>
#include <stdio.h>

/* One line on stderr; returns the exit code of a failed setup. */
static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
    va_list ap;
    fputs(CUDA_TOOL_NAME ": ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 2;
}

/* s as a JSON string on stdout: the tools' reports are written by hand. */
static inline void json_str(const char *s)
{
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

#endif
