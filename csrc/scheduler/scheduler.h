/* Time-slice compute scheduler core, driven by cgpud through cffi.
 * Ownership: the caller owns a cgpu_sched from create to destroy.
 * Thread-safety: one thread drives a scheduler; the core holds no globals.
 * The policies arrive with the compute-isolation issue; today the core only
 * carries its ABI version so the binding and build are real from day one. */
#ifndef CGPU_SCHEDULER_H
#define CGPU_SCHEDULER_H

#define CGPU_SCHED_ABI_VERSION 1

struct cgpu_sched;

int cgpu_sched_abi_version(void);
struct cgpu_sched *cgpu_sched_create(unsigned gpu_count);
unsigned cgpu_sched_gpu_count(const struct cgpu_sched *s);
void cgpu_sched_destroy(struct cgpu_sched *s);

#endif
