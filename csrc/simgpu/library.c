/* Simulated libcuda.so.1: entry points the CUDA runtime (libcudart) needs
 * beyond those the driver-API tools use: the module loading mode, fatbins
 * (the form nvcc embeds code in), the library/kernel API lazy loading goes
 * through, and cuCtxGetDevice_v2 (CUDA 13). The older forms cudart resolves
 * (cuDevicePrimaryCtxRelease at 7000) are in driver_forwards.def. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"

/* As the real driver: CUDA_MODULE_LOADING=EAGER or LAZY, lazy by default
 * (CUDA 12.2 on). */
SIM_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode)
{
    CUresult rc = sim_check_init_args(!mode);
    if (rc)
        return rc;
    const char *env = getenv("CUDA_MODULE_LOADING");
    *mode = env && strcmp(env, "EAGER") == 0 ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}

/* ---- variants ------------------------------------------------------------------ */

/* CUDA 13: the device of a given context, or of the current one for NULL. */
SIM_EXPORT CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    if (!ctx)
        return cuCtxGetDevice(device);
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_ctx_valid((struct sim_ctx *)ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = sim_ordinal(((struct sim_ctx *)ctx)->dev);
    return CUDA_SUCCESS;
}

/* ---- fatbins ---------------------------------------------------------------------
 * The wrapper is documented (fatbinary_section.h); the container it points
 * at is not, and what follows was read off nvcc 13.0's output (every offset
 * checked on -compress-mode none, speed and size, PTX and sm_ code):
 *   header  u32 magic 0xba55ed50, u16 version 1, u16 header size, u64 size
 *           of the entries that follow the header;
 *   entry   u16 kind (1 PTX, 2 ELF), u16 version, u32 header size, u64
 *           payload size (padded); u32 compressed size at 0x10, u32 arch
 *           (75 for compute_75) at 0x1c, u64 flags at 0x28 (0x2000: LZ4,
 *           0x8000: zstd), u64 uncompressed size at 0x38; the payload
 *           follows the entry's header.
 * Compressed PTX is inflated with the system's libzstd / liblz4, loaded
 * when first needed (both are on every distribution cudart runs on); the
 * simulated GPU runs PTX only, as elsewhere (driver_exec.c). */

#define FATBINC_MAGIC 0x466243b1u
#define FATBIN_MAGIC 0xba55ed50u
#define FATBIN_KIND_PTX 1
#define FATBIN_FLAG_LZ4 0x2000u
#define FATBIN_FLAG_ZSTD 0x8000u
#define FATBIN_MAX_PTX (64u << 20)

struct fatbinc_wrapper {
    int magic;
    int version;
    const unsigned long long *data;
    void *filename_or_fatbins;
};

static uint32_t rd32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static uint64_t rd64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* Inflates a compressed payload with the library that provides `fn`. */
static char *inflate(const char *lib, const char *fn, const unsigned char *src, size_t n, size_t out_n)
{
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    void *sym = h ? dlsym(h, fn) : NULL;
    char *out = sym && out_n < FATBIN_MAX_PTX ? calloc(1, out_n + 1) : NULL;
    bool ok = false;
    if (out && strcmp(fn, "ZSTD_decompress") == 0) {
        size_t (*zstd)(void *, size_t, const void *, size_t) = (size_t(*)(void *, size_t, const void *, size_t))sym;
        ok = zstd(out, out_n, src, n) == out_n;
    } else if (out) {
        int (*lz4)(const char *, char *, int, int) = (int (*)(const char *, char *, int, int))sym;
        ok = lz4((const char *)src, out, (int)n, (int)out_n) == (int)out_n;
    }
    if (h)
        dlclose(h);
    if (!ok) {
        free(out);
        return NULL;
    }
    return out;
}

/* The PTX of one fatbin (the newest arch's), as a string the caller frees;
 * NULL when it has none or it is malformed. */
static char *fatbin_ptx(const unsigned char *fb)
{
    if (rd32(fb) != FATBIN_MAGIC)
        return NULL;
    uint32_t hsize = rd32(fb + 4) >> 16;
    uint64_t size = rd64(fb + 8);
    const unsigned char *e = fb + hsize, *end = e + size, *best = NULL;
    while (e + 0x40 <= end) {
        uint32_t ehsize = rd32(e + 4);
        uint64_t payload = rd64(e + 8);
        if (ehsize < 0x40 || ehsize > (uint64_t)(end - e) || payload > (uint64_t)(end - e) - ehsize)
            return NULL;
        if ((rd32(e) & 0xffff) == FATBIN_KIND_PTX && (!best || rd32(e + 0x1c) > rd32(best + 0x1c)))
            best = e;
        e += ehsize + payload;
    }
    if (!best)
        return NULL;
    const unsigned char *data = best + rd32(best + 4);
    uint64_t flags = rd64(best + 0x28), payload = rd64(best + 8);
    uint32_t packed = rd32(best + 0x10);
    uint64_t full = rd32(best + 4) >= 0x40 ? rd64(best + 0x38) : 0;
    if (flags & (FATBIN_FLAG_LZ4 | FATBIN_FLAG_ZSTD)) {
        if (packed > payload || full == 0)
            return NULL;
        return flags & FATBIN_FLAG_ZSTD ? inflate("libzstd.so.1", "ZSTD_decompress", data, packed, full)
                                        : inflate("liblz4.so.1", "LZ4_decompress_safe", data, packed, full);
    }
    if (payload >= FATBIN_MAX_PTX)
        return NULL;
    char *ptx = malloc(payload + 1);
    if (ptx) {
        memcpy(ptx, data, payload);
        ptx[payload] = '\0';
    }
    return ptx;
}

/* PTX text out of whatever cudart or a program hands the driver: a fatbin
 * wrapper, a fatbin, or PTX itself. *owned says whether to free it. */
static const char *image_ptx(const void *image, bool *owned)
{
    const unsigned char *p = image;
    *owned = false;
    /* Magics have no zero byte: a shorter string is PTX (or nothing). */
    if (strnlen(image, 4) == 4 && rd32(p) == FATBINC_MAGIC) {
        const struct fatbinc_wrapper *w = image;
        p = (const unsigned char *)w->data;
        if (!p)
            return NULL;
    }
    if (strnlen((const char *)p, 4) == 4 && rd32(p) == FATBIN_MAGIC) {
        *owned = true;
        return fatbin_ptx(p);
    }
    return image;
}

/* ---- modules from fatbins and libraries -------------------------------------------- */

SIM_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    if (!fatCubin)
        return cuModuleLoadData(module, fatCubin);
    bool owned;
    const char *ptx = image_ptx(fatCubin, &owned);
    CUresult rc = ptx ? cuModuleLoadData(module, ptx) : CUDA_ERROR_NO_BINARY_FOR_GPU;
    if (owned)
        free((void *)ptx);
    return rc;
}

/* A library is its code, loaded as a module per device on first need.
 * cudart loads libraries and looks their kernels up before any context is
 * current (lazy loading): with none current the module is made under
 * device 0's primary context, pushed for the call without being retained
 * (nothing is charged for it). A kernel handle is that module's function;
 * a launch on another device takes the twin loaded there
 * (sim_kernel_function). */
struct sim_library {
    uint32_t magic;
    pthread_mutex_t lock;
    char *ptx;
    CUmodule module[SIM_MAX_GPUS]; /* by simulated GPU */
    struct sim_library *next;
};

#define MAGIC_LIBRARY 0x4c494231

/* Every loaded library, to find the one a kernel handle came from. */
static struct {
    pthread_mutex_t lock;
    struct sim_library *head;
} libraries = {PTHREAD_MUTEX_INITIALIZER, NULL};

static struct sim_library *library_of_module(CUmodule m)
{
    struct sim_library *found = NULL;
    pthread_mutex_lock(&libraries.lock);
    for (struct sim_library *l = libraries.head; l && !found; l = l->next)
        for (int i = 0; i < SIM_MAX_GPUS; i++)
            if (l->module[i] == m)
                found = l;
    pthread_mutex_unlock(&libraries.lock);
    return found;
}

/* The library's module on simulated GPU `phys`, loaded on first need under
 * the current context if it is on that GPU, else under the GPU's primary
 * context pushed for the call (not retained: nothing is charged for it). */
static CUresult library_module_on(struct sim_library *lib, int phys, CUmodule *out)
{
    struct sim_ctx *ctx = sim_current_ctx();
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&lib->lock);
    if (!lib->module[phys]) {
        bool push = !ctx || ctx->dev != phys;
        if (!push || (rc = cuCtxPushCurrent_v2((CUcontext)&sim_drv.primary[phys])) == CUDA_SUCCESS) {
            rc = cuModuleLoadData(&lib->module[phys], lib->ptx);
            CUcontext popped;
            if (push)
                cuCtxPopCurrent_v2(&popped);
        }
    }
    *out = lib->module[phys];
    pthread_mutex_unlock(&lib->lock);
    return rc;
}

/* On the current context's GPU, or device 0's when none is current. */
static CUresult library_module(struct sim_library *lib, CUmodule *out)
{
    struct sim_ctx *ctx = sim_current_ctx();
    int phys;
    CUresult rc = ctx ? CUDA_SUCCESS : sim_device(0, &phys);
    if (rc)
        return rc;
    return library_module_on(lib, ctx ? ctx->dev : phys, out);
}

SIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                      void **jitOptionsValues, unsigned int numJitOptions,
                                      CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                      unsigned int numLibraryOptions)
{
    (void)jitOptions, (void)jitOptionsValues, (void)libraryOptions, (void)libraryOptionValues;
    CUresult rc = sim_check_init_args(!library || !code || (numJitOptions && !jitOptions) ||
                                      (numLibraryOptions && !libraryOptions));
    if (rc)
        return rc;
    bool owned;
    const char *ptx = image_ptx(code, &owned);
    if (!ptx)
        return CUDA_ERROR_NO_BINARY_FOR_GPU;
    struct sim_library *lib = calloc(1, sizeof(*lib));
    char *copy = owned ? (char *)ptx : strdup(ptx);
    if (!lib || !copy) {
        free(lib);
        free(copy);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *lib = (struct sim_library){.magic = MAGIC_LIBRARY, .ptx = copy};
    pthread_mutex_init(&lib->lock, NULL);
    CUmodule m;
    if ((rc = library_module(lib, &m))) {
        pthread_mutex_destroy(&lib->lock);
        free(lib->ptx);
        free(lib);
        return rc;
    }
    pthread_mutex_lock(&libraries.lock);
    lib->next = libraries.head;
    libraries.head = lib;
    pthread_mutex_unlock(&libraries.lock);
    *library = (CUlibrary)lib;
    return CUDA_SUCCESS;
}

SIM_HANDLE_GET(library_get, CUlibrary, struct sim_library, MAGIC_LIBRARY, CUDA_ERROR_INVALID_HANDLE)

SIM_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    struct sim_library *lib;
    CUresult rc = library_get(library, &lib);
    if (rc)
        return rc;
    pthread_mutex_lock(&libraries.lock);
    struct sim_library **at = &libraries.head;
    while (*at && *at != lib)
        at = &(*at)->next;
    if (*at)
        *at = lib->next;
    pthread_mutex_unlock(&libraries.lock);
    for (int i = 0; i < SIM_MAX_GPUS; i++)
        if (lib->module[i])
            cuModuleUnload(lib->module[i]);
    lib->magic = MAGIC_DEAD;
    pthread_mutex_destroy(&lib->lock);
    free(lib->ptx);
    free(lib);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library)
{
    struct sim_library *lib;
    CUresult rc = library_get(library, &lib);
    if (rc)
        return rc;
    if (!pMod)
        return CUDA_ERROR_INVALID_VALUE;
    return library_module(lib, pMod);
}

SIM_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    struct sim_library *lib;
    CUresult rc = library_get(library, &lib);
    CUmodule m;
    if (rc)
        return rc;
    if (!pKernel || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = library_module(lib, &m)))
        return rc;
    return cuModuleGetFunction((CUfunction *)pKernel, m, name);
}

/* A kernel's function on simulated GPU `phys`: itself, or its twin loaded
 * there from its library. A function of a plain module has no twin. */
static CUresult kernel_on(CUkernel kernel, int phys, struct sim_function **out)
{
    struct sim_function *fn = (struct sim_function *)kernel;
    if (!fn || fn->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = fn;
    if (fn->module->dev == phys)
        return CUDA_SUCCESS;
    struct sim_library *lib = library_of_module((CUmodule)fn->module);
    CUmodule m;
    CUresult rc = lib ? library_module_on(lib, phys, &m) : CUDA_ERROR_INVALID_HANDLE;
    return rc ? rc : cuModuleGetFunction((CUfunction *)out, m, fn->name);
}

/* What a launch (or graph node) on the calling thread's device means by a
 * function handle. The real driver takes a CUkernel in place of a CUfunction
 * and runs the kernel's code for the current context, whichever device that
 * is; so a library's kernel loaded for another device gives its twin for
 * this one (loaded on first use). Anything else is itself: a function of a
 * plain module on another device stays an invalid handle there. */
struct sim_function *sim_kernel_function(struct sim_function *fn)
{
    struct sim_ctx *ctx = sim_current_ctx();
    struct sim_function *twin;
    if (!ctx || fn->module->dev == ctx->dev || kernel_on((CUkernel)fn, ctx->dev, &twin))
        return fn;
    return twin;
}

SIM_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    struct sim_ctx *ctx;
    CUresult rc = sim_require_ctx(&ctx);
    struct sim_function *fn = (struct sim_function *)kernel;
    if (rc)
        return rc;
    if (!fn || fn->magic != MAGIC_FUNC || !library_of_module((CUmodule)fn->module))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    return kernel_on(kernel, ctx->dev, (struct sim_function **)pFunc);
}

/* The per-device calls on a kernel act on its function on that device. */
static CUresult kernel_of_device(CUkernel kernel, CUdevice dev, CUfunction *out)
{
    int phys;
    CUresult rc = sim_check_init();
    if (rc || (rc = sim_device(dev, &phys)))
        return rc;
    return kernel_on(kernel, phys, (struct sim_function **)out);
}

SIM_EXPORT CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev)
{
    CUfunction f;
    CUresult rc = kernel_of_device(kernel, dev, &f);
    return rc ? rc : cuFuncGetAttribute(pi, attrib, f);
}

SIM_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev)
{
    CUfunction f;
    CUresult rc = kernel_of_device(kernel, dev, &f);
    return rc ? rc : cuFuncSetAttribute(f, attrib, val);
}

SIM_EXPORT CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice dev)
{
    CUfunction f;
    CUresult rc = kernel_of_device(kernel, dev, &f);
    return rc ? rc : cuFuncSetCacheConfig(f, config);
}

SIM_EXPORT CUresult cuKernelGetName(const char **name, CUkernel hfunc)
{
    CUresult rc = sim_check_init_args(!name);
    if (rc)
        return rc;
    struct sim_function *fn = (struct sim_function *)hfunc;
    if (!fn || fn->magic != MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    *name = fn->name;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel)
{
    CUresult rc = sim_check_init_args(!pLib);
    if (rc)
        return rc;
    struct sim_function *fn = (struct sim_function *)kernel;
    struct sim_library *lib = fn && fn->magic == MAGIC_FUNC ? library_of_module((CUmodule)fn->module) : NULL;
    if (!lib)
        return CUDA_ERROR_INVALID_HANDLE;
    *pLib = (CUlibrary)lib;
    return CUDA_SUCCESS;
}

/* CUDA 13: waits for the work of a given context, or the current one for
 * NULL (cudaDeviceSynchronize goes through it). */
SIM_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    if (!ctx || ctx == (CUcontext)sim_current_ctx())
        return cuCtxSynchronize();
    CUresult rc = sim_check_init();
    if (rc)
        return rc;
    if (!sim_ctx_valid((struct sim_ctx *)ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if ((rc = cuCtxPushCurrent_v2(ctx)))
        return rc;
    rc = cuCtxSynchronize();
    CUcontext popped;
    cuCtxPopCurrent_v2(&popped);
    return rc;
}
