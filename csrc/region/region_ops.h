/* Operations on an instance region (cgpu/region.h) shared by libcgpu.so and
 * cgpud (through cffi): validation, per-process ledgers, charging.
 *
 * Ownership: the caller maps the files and keeps the usage file descriptor
 * open for as long as it holds a ledger. Thread-safety: charging is lock-free;
 * claim and reap must be serialised within a process by the caller (ledger
 * locks belong to one open file description, shared by all its threads). */
#ifndef CGPU_REGION_OPS_H
#define CGPU_REGION_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cgpu/region.h"

uint64_t cgpu_region_checksum(const void *data, size_t len);

/* 0 if the mapped file is a limits/usage region of this version, else -1
 * with a message naming what is wrong. */
int cgpu_limits_check(const struct cgpu_limits *l, size_t file_size, char *err, size_t errlen);
int cgpu_usage_check(const struct cgpu_usage *u, size_t file_size, char *err, size_t errlen);
int cgpu_grants_check(const struct cgpu_grants *g, size_t file_size, char *err, size_t errlen);

/* Claims a free ledger for the calling process and holds its lock on fd,
 * reaping dead processes' ledgers if none is free. One ledger per open file
 * description: a second claim needs its own open() of the usage file. Claims
 * of one instance take turns (on a lock byte; it may wait up to 2 s
 * while another process claims); the first to find no process alive recounts the
 * instance's usage from zero. Returns the ledger index, or -1 when all are
 * taken. */
int cgpu_ledger_claim(struct cgpu_usage *u, int fd, int32_t pid);

/* How many ledgers, from the first, have ever been claimed. */
int cgpu_ledger_count(const struct cgpu_usage *u);

/* Returns the usage of every process whose ledger lock is gone (it died) to
 * the instance. `self` is the caller's own ledger (skipped; -1 for none).
 * Returns the number of ledgers reaped. */
int cgpu_ledger_reap(struct cgpu_usage *u, int fd, int self);

/* Adds `bytes` to the device's usage if it stays within `limit`; one atomic
 * step, so racing processes never exceed the limit together. Out-of-range
 * devices are refused; counters never wrap below zero. */
bool cgpu_usage_reserve(struct cgpu_usage *u, unsigned dev, uint64_t limit, uint64_t bytes);
void cgpu_usage_unreserve(struct cgpu_usage *u, unsigned dev, uint64_t bytes);

/* Resizing a running instance. cgpud stores a device's new live limit, then
 * reads its usage; a charger reserves, then reads the live limit again
 * (cgpu_usage_over_live). All four steps are sequentially consistent, so
 * either cgpud sees the charge (and puts the old limit back when usage
 * exceeds the new one) or the charger sees the new limit (and gives the
 * charge back): a shrink never leaves an instance above its limit.
 * Returns the device's usage after the store (0 for a NULL `u`: publishing
 * a limit that needs no check). */
uint64_t cgpu_grants_store_mem_limit(struct cgpu_grants *g, const struct cgpu_usage *u, unsigned dev, uint64_t limit);
/* After a reserve under `limit`: true if the live limit fell below it
 * meanwhile and the device's usage no longer fits under the new one. */
bool cgpu_usage_over_live(const struct cgpu_usage *u, unsigned dev, const CGPU_ATOMIC uint64_t *live, uint64_t limit);

/* Reserve on the device and record it in a process's ledger; and back. */
bool cgpu_ledger_charge(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t limit, uint64_t bytes);
void cgpu_ledger_uncharge(struct cgpu_usage *u, int ledger, unsigned dev, uint64_t bytes);

#endif
