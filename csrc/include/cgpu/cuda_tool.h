/* What the programs that drive the CUDA driver API themselves (cgpu-burn,
 * bench/intercept_calls) share: the one-line failure report and JSON strings
 * (tool_output.h), the name of a CUresult, and opening the driver to resolve
 * entry points the way the CUDA runtime does. Each program is one file: define CUDA_TOOL_NAME, give the
 * program's state an `f` table holding cuGetErrorName, then include this. */
#ifndef CGPU_CUDA_TOOL_H
#define CGPU_CUDA_TOOL_H

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cgpu/cuda_abi.h"
#include "cgpu/tool_output.h"

/* POSIX: object and function pointers share a representation (dlsym relies
 * on it); copying the bytes avoids a cast ISO C leaves undefined. */
_Static_assert(sizeof(void *) == sizeof(void (*)(void)), "dlsym needs same-size pointers");


/* The driver's own name for r, when the program could resolve cuGetErrorName. */
static const char *result_name(__typeof__(&cuGetErrorName) get_error_name, CUresult r)
{
    const char *s = NULL;
    if (get_error_name && get_error_name(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "CUDA_ERROR_UNRECOGNIZED";
}

/* A setup step: on failure, one line naming the call, and exit code 2. */
#define SETUP(b, call, expr)                                                                      \
    do {                                                                                          \
        CUresult r_ = (expr);                                                                     \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return fail("%s failed: %s (%d)", call, result_name((b)->f.cuGetErrorName, r_), (int)r_); \
    } while (0)

/* libcuda.so.1 and its cuGetProcAddress_v2, through which the runtime finds
 * every other entry point. */
static int open_driver(void **dl, __typeof__(&cuGetProcAddress_v2) *get_proc)
{
    void *pfn;
    if (!(*dl = dlopen("libcuda.so.1", RTLD_NOW)))
        return fail("cannot load libcuda.so.1: %s", dlerror());
    if (!(pfn = dlsym(*dl, "cuGetProcAddress_v2")))
        return fail("cannot resolve cuGetProcAddress_v2 in libcuda.so.1: %s", dlerror());
    memcpy(get_proc, &pfn, sizeof pfn);
    return 0;
}

#endif
