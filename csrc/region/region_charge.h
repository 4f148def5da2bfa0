/* The charging steps of region_ops.h as inline functions: libcgpu's
 * allocation path takes them without a call per step, and region.c's
 * exported cgpu_usage_reserve / cgpu_ledger_charge / cgpu_ledger_uncharge
 * are these, so there is one implementation of the protocol. */
#ifndef CGPU_REGION_CHARGE_H
#define CGPU_REGION_CHARGE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "cgpu/region.h"

/* Subtracts without wrapping: the usage file is writable by the tenant, and
 * a counter that wrapped would lock the whole instance out of memory. */
static inline void cgpu_sub_floor(_Atomic uint64_t *v, uint64_t n)
{
    uint64_t cur = atomic_load_explicit(v, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(v, &cur, cur > n ? cur - n : 0, memory_order_acq_rel,
                                                  memory_order_relaxed)) {
    }
}

/* The _at forms take indices the caller knows are in range (its own
 * ledger, a device of its instance); the others check them. */
static inline bool cgpu_usage_reserve_at(struct cgpu_usage *u, unsigned dev, uint64_t limit, uint64_t bytes)
{
    _Atomic uint64_t *used = &u->device[dev].used;
    uint64_t cur = atomic_load_explicit(used, memory_order_relaxed);
    while (bytes <= limit && cur <= limit - bytes) {
        /* seq_cst: pairs with cgpu_grants_store_mem_limit (region_ops.h) */
        if (atomic_compare_exchange_weak_explicit(used, &cur, cur + bytes, memory_order_seq_cst,
                                                  memory_order_relaxed))
            return true;
    }
    return false;
}

static inline bool cgpu_usage_reserve_inline(struct cgpu_usage *u, unsigned dev, uint64_t limit, uint64_t bytes)
{
    return dev < CGPU_MAX_DEVICES && cgpu_usage_reserve_at(u, dev, limit, bytes);
}

static inline bool cgpu_ledger_charge_at(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t limit,
                                         uint64_t bytes)
{
    if (!cgpu_usage_reserve_at(u, dev, limit, bytes))
        return false;
    /* Device first, ledger second: a process killed in between leaves the
     * bytes counted (safe) rather than a ledger the reaper would subtract
     * from a device that never had them. */
    atomic_fetch_add_explicit(&u->proc[ledger].used[dev], bytes, memory_order_relaxed);
    return true;
}

static inline bool cgpu_ledger_charge_inline(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t limit,
                                             uint64_t bytes)
{
    return ledger >= 0 && ledger < CGPU_MAX_PROCS && dev < CGPU_MAX_DEVICES &&
           cgpu_ledger_charge_at(u, ledger, dev, limit, bytes);
}

/* Ledger first, device second (see cgpu_ledger_charge_at). */
static inline void cgpu_ledger_uncharge_at(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t bytes)
{
    cgpu_sub_floor(&u->proc[ledger].used[dev], bytes);
    cgpu_sub_floor(&u->device[dev].used, bytes);
}

static inline void cgpu_ledger_uncharge_inline(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t bytes)
{
    if (dev >= CGPU_MAX_DEVICES)
        return;
    if (ledger >= 0 && ledger < CGPU_MAX_PROCS)
        cgpu_sub_floor(&u->proc[ledger].used[dev], bytes);
    cgpu_sub_floor(&u->device[dev].used, bytes);
}

#endif
