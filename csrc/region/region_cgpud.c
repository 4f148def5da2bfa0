#define _GNU_SOURCE
#include "region_py.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/mount.h>

/* cgpud's cffi wrapper sees the usage layout with CGPU_ATOMIC defined empty
 * (cffi cannot parse _Atomic); that view is only right while the atomic
 * counters have the size and alignment of the plain integers. */
_Static_assert(sizeof(_Atomic uint64_t) == sizeof(uint64_t) && _Alignof(_Atomic uint64_t) == _Alignof(uint64_t),
               "_Atomic uint64_t differs from uint64_t");
_Static_assert(sizeof(_Atomic uint32_t) == sizeof(uint32_t) && _Alignof(_Atomic uint32_t) == _Alignof(uint32_t),
               "_Atomic uint32_t differs from uint32_t");
_Static_assert(sizeof(_Atomic int32_t) == sizeof(int32_t) && _Alignof(_Atomic int32_t) == _Alignof(int32_t),
               "_Atomic int32_t differs from int32_t");

uint64_t cgpu_device_used(const struct cgpu_usage *u, unsigned dev)
{
    return atomic_load(&u->device[dev].used);
}

uint32_t cgpu_ledger_read(const struct cgpu_usage *u, unsigned i, int32_t *pid, uint64_t used[CGPU_MAX_DEVICES])
{
    const struct cgpu_proc_ledger *p = &u->proc[i];
    uint32_t state = atomic_load(&p->state);
    *pid = atomic_load(&p->pid);
    for (unsigned d = 0; d < CGPU_MAX_DEVICES; d++)
        used[d] = atomic_load(&p->used[d]);
    return state;
}


int cgpu_region_mount(const char *dir, uint64_t bytes)
{
    char opts[128];
    /* Inodes: the root, three files and write_atomic's temporary copies. */
    snprintf(opts, sizeof(opts), "size=%llu,nr_inodes=16,mode=0755", (unsigned long long)bytes);
    return mount("cgpu-region", dir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts) == 0 ? 0 : -errno;
}

int cgpu_region_unmount(const char *dir)
{
    return umount2(dir, MNT_DETACH | UMOUNT_NOFOLLOW) == 0 ? 0 : -errno;
}
