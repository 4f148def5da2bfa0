/* cgpu-bypass: a hostile tenant that allocates GPU memory without passing
 * through libcgpu.so. The watchdog in cgpud exists because of programs like
 * this one, and tests use it to show the hole and that it is closed.
 *
 * libcgpu.so sees a program's CUDA calls only where the dynamic linker or
 * the program asks for a symbol by name: preloaded definitions, dlsym,
 * cuGetProcAddress. This tool does neither:
 *   --resolve elf   dlopen("libcuda.so.1") for the mapping only, then finds
 *                   the entry points by reading the driver's own dynamic
 *                   symbol table (dl_iterate_phdr, DT_GNU_HASH/DT_HASH).
 *                   Works on a real driver as on the simulated one.
 *   --resolve link  calls cu* directly, resolved when the tool was linked.
 *                   Only in builds compiled with -DCGPU_BYPASS_LINK: static
 *                   binaries with the driver inside (no ld.so, so no preload)
 *                   and musl programs (whose loader ignores /etc/ld.so.preload).
 *
 * It creates a context, allocates COUNT chunks of MIB MiB, holds them, then
 * frees them. Output is JSON, one object per line, flushed as it happens;
 * "time" is CLOCK_REALTIME in seconds, so tests can compare it with when
 * another process noticed:
 *   {"event":"ready",...}      the driver is open; cuMemGetInfo's view
 *   {"event":"allocated",...}  one chunk granted, with total_bytes so far
 *   {"event":"refused",...}    the driver refused a chunk (no more are tried)
 *   {"event":"holding",...}    all attempts done, holding starts
 *   {"event":"summary",...}    last line
 *
 * Exit codes: 0 every chunk allocated, held and freed; 1 a CUDA error after
 * the allocations (synchronize or free); 2 bad argument or setup failure
 * (one line on stderr, no summary); 3 the driver refused a chunk. */
#define _GNU_SOURCE

#include <elf.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef CGPU_BYPASS_LINK
#include <dlfcn.h>
#include <link.h>
#endif

#include "cgpu/cuda_abi.h"

#define TOOL "cgpu-bypass"
#define CUDA_TOOL_NAME TOOL
#include "cgpu/tool_output.h"

#define MAX_CHUNKS 4096

#define BYPASS_FUNCTIONS(X) \
    X(cuInit)               \
    X(cuGetErrorName)       \
    X(cuDeviceGet)          \
    X(cuCtxCreate_v2)       \
    X(cuCtxDestroy_v2)      \
    X(cuCtxSynchronize)     \
    X(cuMemGetInfo_v2)      \
    X(cuMemAlloc_v2)        \
    X(cuMemFree_v2)

struct api {
#define X(sym) __typeof__(&sym) sym;
    BYPASS_FUNCTIONS(X)
#undef X
};

struct options {
    int device;
    size_t chunk;
    long count;
    double hold_s;
};

struct tenant {
    struct options opt;
    struct api f;
    const char *object; /* the file the entry points came from */
    CUcontext ctx;
    CUdeviceptr ptrs[MAX_CHUNKS];
    long granted;
    size_t total;
    CUresult refused; /* CUDA_SUCCESS if nothing was */
    int errors;
};

static volatile sig_atomic_t stop_holding;

static double realtime(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *result_name(const struct tenant *t, CUresult r)
{
    const char *s = NULL;
    if (t->f.cuGetErrorName && t->f.cuGetErrorName(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "CUDA_ERROR_UNRECOGNIZED";
}

/* ---- resolving the driver's entry points -------------------------------- */

#ifdef CGPU_BYPASS_LINK
#define RESOLVE_NAME "link"

static int resolve(struct tenant *t)
{
#define X(sym) t->f.sym = sym;
    BYPASS_FUNCTIONS(X)
#undef X
    t->object = "linked";
    return 0;
}

#else
#define RESOLVE_NAME "elf"

struct dynamic {
    ElfW(Addr) base;
    const char *strtab;
    const ElfW(Sym) *symtab;
    const uint32_t *gnu_hash, *sysv_hash;
    const char *name;
};

/* glibc rewrites d_ptr to run-time addresses where the dynamic section is
 * writable (x86_64); musl and read-only sections keep file offsets. */
static const void *dyn_ptr(ElfW(Addr) base, ElfW(Addr) p)
{
    return (const void *)(p < base ? p + base : p);
}

/* dl_iterate_phdr callback: the object mapped at the base dlopen gave. */
static int find_object(struct dl_phdr_info *info, size_t size, void *arg)
{
    struct dynamic *d = arg;
    const ElfW(Dyn) *dyn = NULL;
    (void)size;
    if (info->dlpi_addr != d->base)
        return 0;
    for (ElfW(Half) i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    for (; dyn && dyn->d_tag != DT_NULL; dyn++) {
        const void *p = dyn_ptr(d->base, dyn->d_un.d_ptr);
        switch (dyn->d_tag) {
        case DT_STRTAB: d->strtab = p; break;
        case DT_SYMTAB: d->symtab = p; break;
        case DT_GNU_HASH: d->gnu_hash = p; break;
        case DT_HASH: d->sysv_hash = p; break;
        default: break;
        }
    }
    d->name = info->dlpi_name;
    return 1;
}

/* Plain functions only: an IFUNC's value is its resolver, not the entry. */
static bool defines(const struct dynamic *d, uint32_t ix, const char *name)
{
    const ElfW(Sym) *s = &d->symtab[ix];
    return s->st_shndx != SHN_UNDEF && s->st_value && ELF64_ST_TYPE(s->st_info) == STT_FUNC &&
           strcmp(d->strtab + s->st_name, name) == 0;
}

static uint32_t lookup_gnu(const struct dynamic *d, const char *name)
{
    const uint32_t *hdr = d->gnu_hash;
    uint32_t nbuckets = hdr[0], symoffset = hdr[1], bloom_size = hdr[2], h = 5381;
    const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)(hdr + 4) + bloom_size);
    const uint32_t *chain = buckets + nbuckets;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = h * 33 + *p;
    if (nbuckets == 0)
        return 0;
    for (uint32_t ix = buckets[h % nbuckets], ch = 0; ix != 0 && ix >= symoffset && !(ch & 1); ix++) {
        ch = chain[ix - symoffset];
        if ((ch | 1) == (h | 1) && defines(d, ix, name))
            return ix;
    }
    return 0;
}

static uint32_t lookup_sysv(const struct dynamic *d, const char *name)
{
    uint32_t nbucket = d->sysv_hash[0], nchain = d->sysv_hash[1], h = 0;
    const uint32_t *bucket = d->sysv_hash + 2, *chain = bucket + nbucket;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        h = (h << 4) + *p;
        h = (h ^ ((h & 0xf0000000u) >> 24)) & 0x0fffffffu;
    }
    if (nbucket == 0)
        return 0;
    /* nchain bounds the walk, so a corrupt chain ends. */
    uint32_t steps = 0;
    for (uint32_t ix = bucket[h % nbucket]; ix && ix < nchain && steps++ < nchain; ix = chain[ix])
        if (defines(d, ix, name))
            return ix;
    return 0;
}

static void *symbol(const struct dynamic *d, const char *name)
{
    uint32_t ix = d->gnu_hash ? lookup_gnu(d, name) : lookup_sysv(d, name);
    return ix ? (void *)(d->base + d->symtab[ix].st_value) : NULL;
}

static int resolve(struct tenant *t)
{
    struct link_map *map = NULL;
    void *dl = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!dl)
        return fail("cannot load libcuda.so.1: %s", dlerror());
    if (dlinfo(dl, RTLD_DI_LINKMAP, &map) != 0 || !map)
        return fail("dlinfo of libcuda.so.1: %s", dlerror());
    struct dynamic d = {.base = map->l_addr};
    if (!dl_iterate_phdr(find_object, &d) || !d.strtab || !d.symtab || !(d.gnu_hash || d.sysv_hash))
        return fail("libcuda.so.1 at %#lx: no dynamic symbol table", (unsigned long)d.base);
    t->object = d.name;
    void *p;
#define X(sym)                                                        \
    if (!(p = symbol(&d, #sym)))                                      \
        return fail("%s does not define %s", d.name, #sym);           \
    memcpy(&t->f.sym, &p, sizeof p);
    BYPASS_FUNCTIONS(X)
#undef X
    return 0; /* dl stays open: the driver is in use until exit */
}
#endif

/* ---- arguments ---------------------------------------------------------- */

static int usage(FILE *out, int code)
{
    fprintf(out,
            "usage: " TOOL " [--resolve " RESOLVE_NAME "] [--device N] [--alloc-mib N] [--count K] [--hold S]\n"
            "Allocate K chunks of N MiB on device N with the CUDA driver API, out of\n"
            "libcgpu's sight, hold them S seconds (or until SIGTERM/SIGINT), free them.\n"
            "One JSON object per line on stdout (events ready, allocated, refused,\n"
            "holding, summary; \"time\" is CLOCK_REALTIME seconds).\n\n"
            "  --resolve HOW    this build: " RESOLVE_NAME
#ifdef CGPU_BYPASS_LINK
            " (cu* linked in at build time)\n"
#else
            " (the driver's dynamic symbol table; no dlsym)\n"
#endif
            "  --device N       device ordinal (0)\n"
            "  --alloc-mib N    size of a chunk in MiB (1024)\n"
            "  --count K        chunks to allocate, 1-%d (4)\n"
            "  --hold S         seconds to hold them (0)\n\n"
            "exit: 0 all allocated and freed; 1 a CUDA error after allocating;\n"
            "      2 bad argument or setup failure; 3 the driver refused a chunk\n",
            MAX_CHUNKS);
    return code;
}

static bool number(const char *s, double min, double max, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= min && v <= max))
        return false;
    *out = v;
    return true;
}

/* Returns -1 to go on, or the exit code. */
static int parse(int argc, char **argv, struct options *o)
{
    static const struct option longopts[] = {
        {"resolve", required_argument, NULL, 'r'}, {"device", required_argument, NULL, 'd'},
        {"alloc-mib", required_argument, NULL, 'm'}, {"count", required_argument, NULL, 'c'},
        {"hold", required_argument, NULL, 'h'},      {"help", no_argument, NULL, 'H'},
        {NULL, 0, NULL, 0},
    };
    double v;
    *o = (struct options){.chunk = (size_t)1 << 30, .count = 4};
    opterr = 0;
    for (int c; (c = getopt_long(argc, argv, "+", longopts, NULL)) != -1;) {
        switch (c) {
        case 'r':
            if (strcmp(optarg, RESOLVE_NAME) != 0)
                return fail("--resolve %s: this build resolves only by '" RESOLVE_NAME "'", optarg);
            break;
        case 'd':
            if (!number(optarg, 0, 1024, &v) || v != (int)v)
                return fail("invalid --device '%s'", optarg);
            o->device = (int)v;
            break;
        case 'm':
            if (!number(optarg, 1, 1 << 24, &v) || v != (long)v)
                return fail("invalid --alloc-mib '%s': 1 to %d", optarg, 1 << 24);
            o->chunk = (size_t)v << 20;
            break;
        case 'c':
            if (!number(optarg, 1, MAX_CHUNKS, &v) || v != (long)v)
                return fail("invalid --count '%s': 1 to %d", optarg, MAX_CHUNKS);
            o->count = (long)v;
            break;
        case 'h':
            if (!number(optarg, 0, 1e9, &v))
                return fail("invalid --hold '%s': seconds, 0 to 1e9", optarg);
            o->hold_s = v;
            break;
        case 'H': return usage(stdout, 0);
        default: return fail("unknown option or missing value: %s (see --help)", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return fail("unexpected argument '%s' (see --help)", argv[optind]);
    return -1;
}

/* ---- the tenant --------------------------------------------------------- */

static void on_signal(int sig)
{
    (void)sig;
    stop_holding = 1;
}

/* Installed before anything is printed, so a signal sent on seeing a line
 * always ends the hold (the default would kill us, or, as PID 1 of a
 * container, be ignored). */
static void catch_signals(void)
{
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

/* Until the deadline or a signal; nanosleep returns early on either. */
static void hold(double seconds)
{
    struct timespec end;
    clock_gettime(CLOCK_MONOTONIC, &end);
    double t = (double)end.tv_sec + (double)end.tv_nsec * 1e-9 + seconds;
    end.tv_sec = (time_t)t;
    end.tv_nsec = (long)((t - (double)end.tv_sec) * 1e9);
    while (!stop_holding && clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &end, NULL) == EINTR) {
    }
}

static int open_device(struct tenant *t)
{
    CUdevice dev;
    CUresult r;
    size_t free_b = 0, total_b = 0;
    if ((r = t->f.cuInit(0)) || (r = t->f.cuDeviceGet(&dev, t->opt.device)) ||
        (r = t->f.cuCtxCreate_v2(&t->ctx, 0, dev)) || (r = t->f.cuMemGetInfo_v2(&free_b, &total_b)))
        return fail("opening device %d failed: %s (%d)", t->opt.device, result_name(t, r), (int)r);
    printf("{\"event\":\"ready\",\"time\":%.6f,\"pid\":%ld,\"resolve\":\"" RESOLVE_NAME "\",\"object\":",
           realtime(), (long)getpid());
    json_str(t->object);
    printf(",\"mem_free\":%zu,\"mem_total\":%zu}\n", free_b, total_b);
    return 0;
}

static void allocate(struct tenant *t)
{
    for (long i = 0; i < t->opt.count; i++) {
        CUresult r = t->f.cuMemAlloc_v2(&t->ptrs[i], t->opt.chunk);
        double now = realtime();
        if (r != CUDA_SUCCESS) {
            t->refused = r;
            printf("{\"event\":\"refused\",\"time\":%.6f,\"index\":%ld,\"bytes\":%zu,\"total_bytes\":%zu,"
                   "\"result\":\"%s\"}\n",
                   now, i, t->opt.chunk, t->total, result_name(t, r));
            return;
        }
        t->granted++;
        t->total += t->opt.chunk;
        printf("{\"event\":\"allocated\",\"time\":%.6f,\"index\":%ld,\"bytes\":%zu,\"total_bytes\":%zu}\n", now, i,
               t->opt.chunk, t->total);
    }
}

static void release(struct tenant *t)
{
    CUresult r = t->f.cuCtxSynchronize();
    t->errors += r != CUDA_SUCCESS;
    for (long i = 0; i < t->granted; i++)
        t->errors += t->f.cuMemFree_v2(t->ptrs[i]) != CUDA_SUCCESS;
    t->errors += t->f.cuCtxDestroy_v2(t->ctx) != CUDA_SUCCESS;
}

int main(int argc, char **argv)
{
    static struct tenant t;
    int rc = parse(argc, argv, &t.opt);
    if (rc >= 0)
        return rc;
    /* Lines reach a pipe as they happen: tests time them. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    catch_signals();
    if ((rc = resolve(&t)) || (rc = open_device(&t)))
        return rc;
    allocate(&t);
    printf("{\"event\":\"holding\",\"time\":%.6f,\"seconds\":%.3f,\"total_bytes\":%zu}\n", realtime(), t.opt.hold_s,
           t.total);
    hold(t.opt.hold_s);
    size_t held = t.total;
    release(&t);
    printf("{\"event\":\"summary\",\"time\":%.6f,\"pid\":%ld,\"resolve\":\"" RESOLVE_NAME "\",\"requested\":%ld,"
           "\"allocated\":%ld,\"total_bytes\":%zu,\"refused\":%s%s%s,\"errors\":%d}\n",
           realtime(), (long)getpid(), t.opt.count, t.granted, held, t.refused ? "\"" : "",
           t.refused ? result_name(&t, t.refused) : "null", t.refused ? "\"" : "", t.errors);
    if (fflush(stdout) != 0)
        return fail("cannot write: %s", strerror(errno));
    return t.errors ? 1 : t.refused ? 3 : 0;
}
