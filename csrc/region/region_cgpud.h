/* Small operations on the usage region that cgpud needs through cffi and
 * region_ops.h does not offer: atomic reads of the counters. Python cannot load
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

/* Mounts a tmpfs of `bytes` (rounded up to pages) at `dir` for one instance's
 * region: mode 0755 (it is the container's /run/cgpu), nosuid, nodev, noexec,
 * a handful of inodes. 0, or -errno (-EPERM without CAP_SYS_ADMIN). */
int cgpu_region_mount(const char *dir, uint64_t bytes);
/* Detaches the mount at `dir` lazily: containers may still hold bind mounts
 * of its files. 0, or -errno. */
int cgpu_region_unmount(const char *dir);

#endif
