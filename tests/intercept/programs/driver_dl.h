/* How the tenant programs here reach the driver: as the CUDA runtime does,
 * dlopen("libcuda.so.1") and dlsym, so that libcgpu's interposition is met
 * the way applications meet it. Included once by each program (its own
 * copy of the handle); not thread-safe until driver_open has returned. */
#ifndef CGPU_TEST_DRIVER_DL_H
#define CGPU_TEST_DRIVER_DL_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static void *driver_lib;

/* The driver's entry point `name`; exits 2 when it has none. */
static void *sym(const char *name)
{
    void *p = dlsym(driver_lib, name);
    if (!p) {
        fprintf(stderr, "no %s\n", name);
        exit(2);
    }
    return p;
}

#define FN(name) ((__typeof__(&name))sym(#name))

/* Opens libcuda.so.1; exits 2 with dlerror's text when it cannot. */
static void driver_open(void)
{
    driver_lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!driver_lib) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
}

/* What libcgpu has charged this process on the current context's device:
 * its limit less the free memory it reports. Exits 3 if it reports none. */
static inline size_t charged(void)
{
    size_t free_b = 0, total = 0;
    if (FN(cuMemGetInfo_v2)(&free_b, &total) != CUDA_SUCCESS)
        exit(3);
    return total - free_b;
}

#endif
