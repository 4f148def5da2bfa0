#define _GNU_SOURCE
#include "region_cgpud.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
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

int cgpu_region_move(const char *from, const char *to)
{
    return mount(from, to, NULL, MS_MOVE, NULL) == 0 ? 0 : -errno;
}
