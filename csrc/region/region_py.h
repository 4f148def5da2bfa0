/* Small operations on the usage region that cgpud needs through cffi and
 * region.h does not offer: atomic reads of the counters. Python cannot load
 * shared memory atomically, so each read is one C call here.
 *
 * Ownership: the caller maps the usage file. Thread-safety: every function
 * is a set of independent atomic operations; a ledger read is not a snapshot
 * of all its fields at one instant. */
#ifndef CGPU_REGION_PY_H
#define CGPU_REGION_PY_H

#include <stdint.h>

#include "cgpu/region.h"

/* Bytes all processes of the instance hold on device `dev`. */
uint64_t cgpu_device_used(const struct cgpu_usage *u, unsigned dev);

/* Returns the state of ledger `i` (enum cgpu_ledger_state) and fills its pid
 * and per-device usage. */
uint32_t cgpu_ledger_read(const struct cgpu_usage *u, unsigned i, int32_t *pid, uint64_t used[CGPU_MAX_DEVICES]);

#endif
