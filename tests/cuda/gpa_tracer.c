#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

/* LD_PRELOAD tracer of a CUDA runtime's driver entry points
 * (tests/intercept/test_cudart_resolution.py): prints "GPA <name> <version>
 * <flags>" on stderr for every cuGetProcAddress(_v2) request. libcudart
 * finds cuGetProcAddress_v2 with dlsym (its one dlsym into the driver, seen
 * with gdb), then asks it for everything, itself included, so the wrapper
 * hands itself out for those answers too. */
typedef int (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);
typedef int (*gpa1_fn)(const char *, void **, int, unsigned long long);
static gpa2_fn real2;
static gpa1_fn real1;

static int traced2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);
static int traced1(const char *symbol, void **pfn, int version, unsigned long long flags);

static void substitute(const char *symbol, void **pfn, int version)
{
    if (!pfn || !*pfn || strcmp(symbol, "cuGetProcAddress") != 0)
        return;
    if (version >= 12000) {
        real2 = (gpa2_fn)*pfn;
        *pfn = (void *)traced2;
    } else {
        real1 = (gpa1_fn)*pfn;
        *pfn = (void *)traced1;
    }
}

static int traced2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    fprintf(stderr, "GPA %s %d %llu\n", symbol, version, flags);
    int rc = real2(symbol, pfn, version, flags, status);
    if (rc == 0)
        substitute(symbol, pfn, version);
    return rc;
}

static int traced1(const char *symbol, void **pfn, int version, unsigned long long flags)
{
    fprintf(stderr, "GPA %s %d %llu\n", symbol, version, flags);
    int rc = real1(symbol, pfn, version, flags);
    if (rc == 0)
        substitute(symbol, pfn, version);
    return rc;
}

void *dlsym(void *handle, const char *symbol)
{
    static void *(*next)(void *, const char *);
    if (!next) {
        static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
        for (unsigned i = 0; i < sizeof(versions) / sizeof(versions[0]) && !next; i++)
            next = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    }
    void *found = next ? next(handle, symbol) : NULL;
    if (found && strcmp(symbol, "cuGetProcAddress_v2") == 0) {
        real2 = (gpa2_fn)found;
        return (void *)traced2;
    }
    return found;
}
