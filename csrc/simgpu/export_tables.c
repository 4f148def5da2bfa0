/* Simulated libcuda.so.1: cuGetExportTable, the driver's private tables.
 *
 * cuda.h documents cuGetExportTable but not its tables: each is an array of
 * pointers found by a 16-byte UUID, and libcudart (and cuBLAS, CUPTI, ...)
 * reach the driver through them beside the public entry points. Everything
 * here was learned by tracing the real libcudart.so.13 of the CUDA 13.0
 * toolkit against this simulator with gdb (which UUIDs it asks for, in which
 * order, which slots it calls with which arguments, what it does with the
 * answers), cross-checked against public descriptions of these tables
 * (ZLUDA's dark_api, among others; no code taken from them). Each table
 * below says what is known and what is guessed.
 *
 * Layout facts shared by most tables: slot 0 holds the table's size in bytes
 * (libcudart reads it to know which slots exist); a slot nobody has seen
 * called answers CUDA_ERROR_NOT_SUPPORTED through a function of its own, so
 * a caller never jumps through NULL and gdb names the slot
 * (export_slot_<table>_<n>). Unknown UUIDs get CUDA_ERROR_INVALID_VALUE.
 *
 * The order libcudart 13.0 asks at its first call (cudaGetDeviceCount):
 * f8cff951 (refused: it goes on), cudart interface, tools runtime callback
 * hooks (slot 2 of the cudart interface, then slots 2 and 6 of the hooks),
 * tools TLS, context-local storage, context checks (slot 3), integrity check
 * (slot 1 three times, for 13000, 13001 and 13002). Allocations, memory
 * info, launches and graphs then use only the context-local storage and
 * context checks slot 2 (docs/simulated-gpu.md, "CUDA runtime"). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"

#define TABLE_BYTES(n) ((const void *)(uintptr_t)((n) * sizeof(void *)))

/* A slot whose meaning is unknown: a distinct function per slot. */
#define UNKNOWN_SLOT(table, n)                                   \
    static CUresult export_slot_##table##_##n(void)              \
    {                                                            \
        return CUDA_ERROR_NOT_SUPPORTED;                         \
    }

/* ---- MD2 and HMAC-MD2 (RFC 1319, RFC 2104), for the integrity check ---------- */

/* RFC 1319's permutation of 0..255, from the digits of pi. */
static const uint8_t md2_s[256] = {
    41,  46,  67,  201, 162, 216, 124, 1,   61,  54,  84,  161, 236, 240, 6,   19,  98,  167, 5,   243, 192, 199,
    115, 140, 152, 147, 43,  217, 188, 76,  130, 202, 30,  155, 87,  60,  253, 212, 224, 22,  103, 66,  111, 24,
    138, 23,  229, 18,  190, 78,  196, 214, 218, 158, 222, 73,  160, 251, 245, 142, 187, 47,  238, 122, 169, 104,
    121, 145, 21,  178, 7,   63,  148, 194, 16,  137, 11,  34,  95,  33,  128, 127, 93,  154, 90,  144, 50,  39,
    53,  62,  204, 231, 191, 247, 151, 3,   255, 25,  48,  179, 72,  165, 181, 209, 215, 94,  146, 42,  172, 86,
    170, 198, 79,  184, 56,  210, 150, 164, 125, 182, 118, 252, 107, 226, 156, 116, 4,   241, 69,  157, 112, 89,
    100, 113, 135, 32,  134, 91,  207, 101, 230, 45,  168, 2,   27,  96,  37,  173, 174, 176, 185, 246, 28,  70,
    97,  105, 52,  64,  126, 15,  85,  71,  163, 35,  221, 81,  175, 58,  195, 92,  249, 206, 186, 197, 234, 38,
    44,  83,  13,  110, 133, 40,  132, 9,   211, 223, 205, 244, 65,  129, 77,  82,  106, 220, 55,  200, 108, 193,
    171, 250, 36,  225, 123, 8,   12,  189, 177, 74,  120, 136, 149, 139, 227, 99,  232, 109, 233, 203, 213, 254,
    59,  0,   29,  57,  242, 239, 183, 14,  102, 88,  208, 228, 166, 119, 114, 248, 235, 117, 75,  10,  49,  68,
    80,  180, 143, 237, 31,  26,  219, 153, 141, 51,  159, 17,  131, 20,
};

struct md2 {
    uint8_t x[48]; /* digest, block, block ^ digest */
    uint8_t c[16]; /* checksum */
    uint8_t used;  /* bytes in the current block */
    uint8_t last;  /* L of RFC 1319 3.2 */
};

static void md2_byte(struct md2 *m, uint8_t b)
{
    unsigned j = m->used;
    m->x[16 + j] = b;
    m->x[32 + j] = (uint8_t)(b ^ m->x[j]);
    m->c[j] ^= md2_s[b ^ m->last];
    m->last = m->c[j];
    m->used = (uint8_t)((j + 1) & 15);
    if (m->used)
        return;
    unsigned t = 0;
    for (unsigned round = 0; round < 18; round++) {
        for (unsigned k = 0; k < 48; k++)
            t = m->x[k] ^= md2_s[t];
        t = (t + round) & 0xff;
    }
}

static void md2_update(struct md2 *m, const void *data, size_t n)
{
    for (size_t i = 0; i < n; i++)
        md2_byte(m, ((const uint8_t *)data)[i]);
}

static void md2_final(struct md2 *m, uint8_t out[16])
{
    uint8_t pad = (uint8_t)(16 - m->used), c[16];
    for (unsigned i = 0; i < pad; i++)
        md2_byte(m, pad);
    memcpy(c, m->c, sizeof(c));
    md2_update(m, c, sizeof(c));
    memcpy(out, m->x, 16);
}

/* HMAC with MD2's 16-byte block: key ^ 0x36 || message, then key ^ 0x5c. */
static void hmac_md2_start(struct md2 *m, const uint8_t key[16])
{
    uint8_t k[16];
    memset(m, 0, sizeof(*m));
    for (int i = 0; i < 16; i++)
        k[i] = key[i] ^ 0x36;
    md2_update(m, k, sizeof(k));
}

static void hmac_md2_finish(struct md2 *m, const uint8_t key[16], uint8_t out[16])
{
    uint8_t inner[16], k[16];
    md2_final(m, inner);
    memset(m, 0, sizeof(*m));
    for (int i = 0; i < 16; i++)
        k[i] = key[i] ^ 0x5c;
    md2_update(m, k, sizeof(k));
    md2_update(m, inner, sizeof(inner));
    md2_final(m, out);
}

/* ---- tables the integrity check hashes by address ----------------------------- */

static const void *const cudart_interface[13];
static const void *const integrity_table[3];

/* ---- cudart interface 6bd5fb6c-5bf4-e74a-8987-d93912fd9df9 --------------------
 * Known: 13 slots (slot 0 says 13 * 8 bytes); libcudart refuses to start
 * without it (cudaErrorNotSupported). Slot 2 gives the primary context of a
 * device: called once per device as the runtime makes its per-device state,
 * before any public context call. It is a retain: the runtime balances it
 * with one cuDevicePrimaryCtxRelease at exit. The other slots were never
 * seen called by libcudart 13.0 (public notes say 1, 6 and 8 load modules
 * from fatbins for older runtimes; this one loads code with
 * cuLibraryLoadData instead, library.c). libcudart 13.5 also calls slot 12
 * once at start, with no arguments, after cuModuleGetLoadingMode; anything
 * but 0 stops it with cudaErrorNotSupported (seen with gdb). Guessed: what
 * it checks; a driver that has the slot answers 0 on a healthy system. */

static CUresult cudart_primary_ctx(CUcontext *pctx, CUdevice dev)
{
    return cuDevicePrimaryCtxRetain(pctx, dev);
}

static CUresult cudart_start_check(void)
{
    return CUDA_SUCCESS;
}

UNKNOWN_SLOT(cudart, 1)
UNKNOWN_SLOT(cudart, 3)
UNKNOWN_SLOT(cudart, 4)
UNKNOWN_SLOT(cudart, 5)
UNKNOWN_SLOT(cudart, 6)
UNKNOWN_SLOT(cudart, 7)
UNKNOWN_SLOT(cudart, 8)
UNKNOWN_SLOT(cudart, 9)
UNKNOWN_SLOT(cudart, 10)
UNKNOWN_SLOT(cudart, 11)

static const void *const cudart_interface[13] = {
    TABLE_BYTES(13),
    (const void *)export_slot_cudart_1,
    (const void *)cudart_primary_ctx,
    (const void *)export_slot_cudart_3,
    (const void *)export_slot_cudart_4,
    (const void *)export_slot_cudart_5,
    (const void *)export_slot_cudart_6,
    (const void *)export_slot_cudart_7,
    (const void *)export_slot_cudart_8,
    (const void *)export_slot_cudart_9,
    (const void *)export_slot_cudart_10,
    (const void *)export_slot_cudart_11,
    (const void *)cudart_start_check,
};

/* ---- tools runtime callback hooks a094798c-2e74-2e74-93f2-0800200c0a66 --------
 * Known: 7 slots; slots 2 and 6 are each called once at start with
 * (void **buffer, size_t *size) and return nothing: they hand the runtime
 * memory where profilers' callbacks would be registered. Guessed: the
 * sizes, 1024 and 14, are what public reimplementations answer; whether
 * they count bytes or words is not known, so each buffer holds that many
 * words. Zeroes mean "no tool attached". */

#define HOOKS_SIZE_2 1024
#define HOOKS_SIZE_6 14

static _Alignas(16) void *hooks_buffer_2[HOOKS_SIZE_2];
static _Alignas(16) void *hooks_buffer_6[HOOKS_SIZE_6];

static void hooks_buffer_of_2(void **buffer, size_t *size)
{
    *buffer = hooks_buffer_2;
    *size = HOOKS_SIZE_2;
}

static void hooks_buffer_of_6(void **buffer, size_t *size)
{
    *buffer = hooks_buffer_6;
    *size = HOOKS_SIZE_6;
}

UNKNOWN_SLOT(hooks, 1)
UNKNOWN_SLOT(hooks, 3)
UNKNOWN_SLOT(hooks, 4)
UNKNOWN_SLOT(hooks, 5)

static const void *const hooks_table[7] = {
    TABLE_BYTES(7),
    (const void *)export_slot_hooks_1,
    (const void *)hooks_buffer_of_2,
    (const void *)export_slot_hooks_3,
    (const void *)export_slot_hooks_4,
    (const void *)export_slot_hooks_5,
    (const void *)hooks_buffer_of_6,
};

/* ---- tools TLS 42d85a81-23f6-cb47-8298-f6e78a3aecdc --------------------------
 * Known: asked for at start and required (the runtime fails without it);
 * none of its slots was seen called by the runtime. Guessed: 4 slots, slot
 * 2 giving the calling thread's context (what a profiler-facing table would
 * need; other libraries are reported to use it so). */

static CUresult tools_tls_current(CUcontext *pctx)
{
    return cuCtxGetCurrent(pctx);
}

UNKNOWN_SLOT(tls, 1)
UNKNOWN_SLOT(tls, 3)

static const void *const tools_tls_table[4] = {
    TABLE_BYTES(4),
    (const void *)export_slot_tls_1,
    (const void *)tools_tls_current,
    (const void *)export_slot_tls_3,
};

/* ---- context-local storage c693336e-1121-df11-a8c3-68f355d89593 --------------
 * Known: no size slot; slot 0 stores (context, key, value, destructor),
 * slot 1 forgets (context, key), slot 2 looks up (value *, context, key) and
 * fails when nothing is stored, which is how the runtime finds out a
 * context is new to it. A NULL context means the calling thread's. The
 * runtime keeps its per-context state here: it looks it up at every call,
 * stores it at a context's first use and forgets it at exit. Guessed:
 * the error code of a failed lookup (CUDA_ERROR_INVALID_HANDLE); the
 * destructors, which the real driver calls when the context is destroyed,
 * are kept but not called (the simulated primary context is never freed,
 * and cudaDeviceReset works without: the runtime forgets its state). */

struct cls_entry {
    CUcontext ctx;
    void *key;
    void *value;
    void (*dtor)(CUcontext, void *, void *);
    struct cls_entry *next;
};

static struct {
    pthread_mutex_t lock;
    struct cls_entry *head;
} cls = {PTHREAD_MUTEX_INITIALIZER, NULL};

static CUresult cls_context(CUcontext ctx, CUcontext *out)
{
    if (!ctx && cuCtxGetCurrent(&ctx) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = ctx;
    return CUDA_SUCCESS;
}

static struct cls_entry **cls_find(CUcontext ctx, void *key)
{
    struct cls_entry **e = &cls.head;
    while (*e && ((*e)->ctx != ctx || (*e)->key != key))
        e = &(*e)->next;
    return e;
}

static CUresult cls_put(CUcontext ctx, void *key, void *value, void (*dtor)(CUcontext, void *, void *))
{
    CUresult rc = cls_context(ctx, &ctx);
    if (rc)
        return rc;
    pthread_mutex_lock(&cls.lock);
    struct cls_entry **e = cls_find(ctx, key);
    if (!*e && (*e = calloc(1, sizeof(**e)))) {
        (*e)->ctx = ctx;
        (*e)->key = key;
    }
    if (*e) {
        (*e)->value = value;
        (*e)->dtor = dtor;
    }
    rc = *e ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_unlock(&cls.lock);
    return rc;
}

static CUresult cls_delete(CUcontext ctx, void *key)
{
    CUresult rc = cls_context(ctx, &ctx);
    if (rc)
        return rc;
    pthread_mutex_lock(&cls.lock);
    struct cls_entry **e = cls_find(ctx, key), *gone = *e;
    if (gone)
        *e = gone->next;
    pthread_mutex_unlock(&cls.lock);
    free(gone);
    return CUDA_SUCCESS;
}

static CUresult cls_get(void **value, CUcontext ctx, void *key)
{
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    *value = NULL;
    CUresult rc = cls_context(ctx, &ctx);
    if (rc)
        return rc;
    pthread_mutex_lock(&cls.lock);
    struct cls_entry *e = *cls_find(ctx, key);
    if (e)
        *value = e->value;
    pthread_mutex_unlock(&cls.lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

UNKNOWN_SLOT(cls, 3)

static const void *const cls_table[4] = {
    (const void *)cls_put,
    (const void *)cls_delete,
    (const void *)cls_get,
    (const void *)export_slot_cls_3,
};

/* ---- context checks 263e8860-7cd2-6143-92f6-bbd5006dfa7e ---------------------
 * Known: required at start; slot 3 is called once with no meaningful
 * arguments and its result 0 lets the runtime go on. Slot 2 is called with
 * (context, unsigned *, pointer *) at a context's first use, before each
 * launch and in cudaDeviceSynchronize; answering success, 0 and NULL lets
 * the runtime go on. Guessed: what it asks (whether the context needs
 * anything special of the runtime); slots 0 and 1 were never seen called. */

static unsigned ctx_checks_global(void)
{
    return 0;
}

static CUresult ctx_checks_context(CUcontext ctx, unsigned *flags, const void **detail)
{
    (void)ctx;
    if (flags)
        *flags = 0;
    if (detail)
        *detail = NULL;
    return CUDA_SUCCESS;
}

UNKNOWN_SLOT(checks, 0)
UNKNOWN_SLOT(checks, 1)

static const void *const ctx_checks_table[4] = {
    (const void *)export_slot_checks_0,
    (const void *)export_slot_checks_1,
    (const void *)ctx_checks_context,
    (const void *)ctx_checks_global,
};

/* ---- integrity check d4082055-bde6-704b-8d34-ba123c66e1f2 --------------------
 * Known: slot 1 (unsigned version, uint64_t unix_seconds, uint64_t out[2])
 * is called at start for version 13000, 13001 and 13002; a wrong answer
 * stops the runtime (cudaErrorSoftwareValidityNotEstablished, or
 * cudaErrorNotSupported when the slot fails). For versions ending in 0 and 1
 * the answer is a constant; otherwise it is HMAC-MD2 under a fixed 16-byte
 * key of: driver version, version, pid, the calling thread's id, the
 * addresses of the cudart interface table, of this table and of this
 * function, the seconds; then per device its UUID and PCI domain, bus and
 * device numbers. These facts are from public reimplementations (ZLUDA's
 * test vector reproduces with the code below); libcudart 13.0 accepts the
 * answers, which is the check. */

static const uint8_t integrity_key[16] = {0x14, 0x6a, 0xdd, 0xae, 0x53, 0xa9, 0xa7, 0x52,
                                          0xaa, 0x08, 0x41, 0x36, 0x0b, 0xf5, 0x5a, 0x9f};

struct integrity_input {
    uint32_t driver_version, version, pid, thread;
    const void *cudart_table, *integrity_table, *function;
    uint64_t unix_seconds;
};

struct integrity_device {
    CUuuid uuid;
    int32_t pci_domain, pci_bus, pci_device;
};

_Static_assert(sizeof(struct integrity_input) == 48, "hashed as 48 bytes");
_Static_assert(sizeof(struct integrity_device) == 28, "hashed as 28 bytes");

static CUresult integrity_check(unsigned version, uint64_t unix_seconds, uint64_t out[2])
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (version % 10 < 2) {
        out[0] = version % 10 ? 0x1841181c03cb675cULL : 0x3341181c03cb675cULL;
        out[1] = 0x8ed383aa1f4cd1e8ULL;
        return CUDA_SUCCESS;
    }
    int driver = 0, count = 0;
    CUresult rc = cuDriverGetVersion(&driver);
    if (!rc)
        rc = cuDeviceGetCount(&count);
    if (rc)
        return rc;
    struct integrity_input in = {
        .driver_version = (uint32_t)driver,
        .version = version,
        .pid = (uint32_t)getpid(),
        .thread = (uint32_t)(uintptr_t)pthread_self(),
        .cudart_table = cudart_interface,
        .integrity_table = integrity_table,
        .function = (const void *)integrity_check,
        .unix_seconds = unix_seconds,
    };
    struct md2 m;
    hmac_md2_start(&m, integrity_key);
    md2_update(&m, &in, sizeof(in));
    for (int dev = 0; dev < count; dev++) {
        struct integrity_device d;
        memset(&d, 0, sizeof(d));
        if ((rc = cuDeviceGetUuid_v2(&d.uuid, dev)) ||
            (rc = cuDeviceGetAttribute(&d.pci_domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, dev)) ||
            (rc = cuDeviceGetAttribute(&d.pci_bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev)) ||
            (rc = cuDeviceGetAttribute(&d.pci_device, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, dev)))
            return rc;
        md2_update(&m, &d, sizeof(d));
    }
    uint8_t digest[16];
    hmac_md2_finish(&m, integrity_key, digest);
    memcpy(out, digest, sizeof(digest));
    return CUDA_SUCCESS;
}

UNKNOWN_SLOT(integrity, 2)

static const void *const integrity_table[3] = {
    TABLE_BYTES(3),
    (const void *)integrity_check,
    (const void *)export_slot_integrity_2,
};

/* ---- context table 21318c60-9714-3248-8ca6-41ff7324c8f2 ----------------------
 * Known: libcudart 13.5 asks for it at start, right after the tools runtime
 * callback hooks, and fails every call with cudaErrorInvalidValue without
 * it (13.0 never asks); none of its slots was seen called through device
 * query, memory, launches, graphs and reset. Public dumps of real drivers
 * (590 and later) show 94 slots after the size slot, slots 3 and 4 giving a
 * context's device and number. Guessed: everything about the slots; each
 * answers CUDA_ERROR_NOT_SUPPORTED through one function gdb names. */

#define CONTEXT_TABLE_SLOTS 95

static CUresult export_slot_context_unknown(void)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define CONTEXT_SLOT (const void *)export_slot_context_unknown
#define CONTEXT_SLOTS_8 CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT, \
                        CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT

static const void *const context_table[CONTEXT_TABLE_SLOTS] = {
    TABLE_BYTES(CONTEXT_TABLE_SLOTS),
    CONTEXT_SLOTS_8, CONTEXT_SLOTS_8, CONTEXT_SLOTS_8, CONTEXT_SLOTS_8, CONTEXT_SLOTS_8, CONTEXT_SLOTS_8,
    CONTEXT_SLOTS_8, CONTEXT_SLOTS_8, CONTEXT_SLOTS_8, CONTEXT_SLOTS_8, CONTEXT_SLOTS_8,
    CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT, CONTEXT_SLOT,
};
_Static_assert(sizeof(context_table) / sizeof(context_table[0]) == CONTEXT_TABLE_SLOTS, "every slot filled");

/* ---- the lookup ------------------------------------------------------------------ */

static const struct {
    uint8_t uuid[16];
    const void *const *table;
} export_tables[] = {
    {{0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9},
     cudart_interface},
    {{0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66}, hooks_table},
    {{0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc},
     tools_tls_table},
    {{0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93}, cls_table},
    {{0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e},
     ctx_checks_table},
    {{0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2},
     integrity_table},
    {{0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2}, context_table},
};

/* f8cff951-2146-8b4e-b9e2-fb469e7c0dd9, asked first of all (before cuInit),
 * is refused: the runtime goes on without it, and public notes say success
 * would send it down another start-up path. */
SIM_EXPORT CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId)
{
    if (!ppExportTable || !pExportTableId)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(export_tables) / sizeof(export_tables[0]); i++) {
        if (memcmp(export_tables[i].uuid, pExportTableId->bytes, 16) == 0) {
            *ppExportTable = export_tables[i].table;
            return CUDA_SUCCESS;
        }
    }
    *ppExportTable = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
