/* libcgpu.so: reaching the real driver, and making sure every way a program
 * reaches the driver (linking, dlsym, dlvsym, RTLD_NEXT, cuGetProcAddress
 * and the pointer it returns for itself) leads through our hooks. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "libcgpu.h"
#include "resolve.h"

enum cgpu_library { LIB_CUDA, LIB_NVML, LIB_LIBC };

void *_Atomic g_real[HOOK_COUNT];

void *const g_hook[HOOK_COUNT] = {
#define HOOK(symbol, library) (void *)symbol,
#define USE(symbol, library) NULL,
#include "hooks.def"
#undef USE
#undef HOOK
};

const char *const g_hook_name[HOOK_COUNT] = {
#define HOOK(symbol, library) #symbol,
#define USE HOOK
#include "hooks.def"
#undef USE
#undef HOOK
};

static const unsigned char hook_library[HOOK_COUNT] = {
#define HOOK(symbol, library) LIB_##library,
#define USE HOOK
#include "hooks.def"
#undef USE
#undef HOOK
};

static void *driver_handle(enum cgpu_library lib)
{
    static void *_Atomic handle[2];
    static const char *const soname[2] = {"libcuda.so.1", "libnvidia-ml.so.1"};
    void *h = atomic_load(&handle[lib]);
    if (!h) {
        /* Already loaded whenever a program reaches a hook; loading it
         * ourselves is the fallback, as the program was about to. */
        h = dlopen(soname[lib], RTLD_NOW | RTLD_NOLOAD);
        if (!h)
            h = dlopen(soname[lib], RTLD_NOW);
        if (h)
            atomic_store(&handle[lib], h);
    }
    return h;
}

void *cgpu_resolve_real(enum cgpu_hook_id id)
{
    void *p = NULL;
    if (hook_library[id] == LIB_LIBC) {
        p = id == HOOK_dlsym ? (void *)cgpu_real_dlsym() : (void *)cgpu_real_dlvsym();
    } else {
        void *h = driver_handle(hook_library[id]);
        cgpu_dlsym_fn real_dlsym = cgpu_real_dlsym();
        if (h && real_dlsym)
            p = real_dlsym(h, g_hook_name[id]);
    }
    if (p)
        atomic_store_explicit(&g_real[id], p, memory_order_release);
    return p;
}

/* Runs inside dlsym, which the ASan runtime calls before its shadow memory
 * exists: the first-letter test lets those calls through untouched. */
static CGPU_NO_ASAN int hook_id_by_name(const char *name)
{
    if (!name || !((name[0] == 'c' && name[1] == 'u') ||
                   (name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l')))
        return -1;
    for (int i = 0; i < HOOK_COUNT; i++) {
        if (g_hook[i] && hook_library[i] != LIB_LIBC && strcmp(g_hook_name[i], name) == 0)
            return i;
    }
    return -1;
}

void *cgpu_hook_by_name(const char *name)
{
    int id = hook_id_by_name(name);
    return id >= 0 ? g_hook[id] : NULL;
}

void *cgpu_substitute(void *fn)
{
    if (!fn || cgpu_state() == CGPU_PASSTHROUGH)
        return fn;
    for (int i = 0; i < HOOK_COUNT; i++) {
        if (g_hook[i] && hook_library[i] != LIB_LIBC && cgpu_real((enum cgpu_hook_id)i) == fn)
            return g_hook[i];
    }
    return fn;
}

/* What dlsym found for `name`: our hook if it is the driver's function. */
static CGPU_NO_ASAN void *substitute_named(const char *name, void *found)
{
    int id = hook_id_by_name(name);
    if (id < 0 || !found || cgpu_state() == CGPU_PASSTHROUGH)
        return found;
    return found == cgpu_real((enum cgpu_hook_id)id) ? g_hook[id] : found;
}

CGPU_EXPORT CGPU_NO_ASAN void *dlsym(void *handle, const char *name)
{
    void *found;
    if (handle == RTLD_NEXT) {
        /* Relative to our caller, not to us: passing RTLD_NEXT on would
         * resolve past libcgpu.so and skip whatever the caller expects. */
        found = cgpu_dlsym_next(__builtin_return_address(0), name, NULL);
    } else {
        cgpu_dlsym_fn real = cgpu_real_dlsym();
        found = real ? real(handle, name) : NULL;
    }
    return substitute_named(name, found);
}

CGPU_EXPORT CGPU_NO_ASAN void *dlvsym(void *handle, const char *name, const char *version)
{
    void *found;
    if (handle == RTLD_NEXT) {
        found = cgpu_dlsym_next(__builtin_return_address(0), name, version);
    } else {
        cgpu_dlvsym_fn real = cgpu_real_dlvsym();
        found = real ? real(handle, name, version) : NULL;
    }
    return substitute_named(name, found);
}

/* The driver decides which variant a (name, cudaVersion, flags) gets; we
 * only swap in our hook when that variant is one we hook, so the runtime
 * keeps the ABI it asked for. A pointer for cuGetProcAddress itself comes
 * back as our hook too. */
CGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus)
{
    __typeof__(&cuGetProcAddress_v2) real = REAL(cuGetProcAddress_v2);
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn)
        *pfn = cgpu_substitute(*pfn);
    return rc;
}

CGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    __typeof__(&cuGetProcAddress) real = REAL(cuGetProcAddress);
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn)
        *pfn = cgpu_substitute(*pfn);
    return rc;
}
