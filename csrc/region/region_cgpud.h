/* The region operations only cgpud needs (through cffi), beside the ones it
 * shares with libcgpu.so in region_ops.h: one tmpfs per instance region.
 *
 * Thread-safety: each function is one system call. */
#ifndef CGPU_REGION_CGPUD_H
#define CGPU_REGION_CGPUD_H

#include <stdint.h>

/* Mounts a tmpfs of `bytes` (rounded up to pages) at `dir` for one instance's
 * region: mode 0755 (it is the container's /run/cgpu), nosuid, nodev, noexec,
 * a handful of inodes. 0, or -errno (-EPERM without CAP_SYS_ADMIN). */
int cgpu_region_mount(const char *dir, uint64_t bytes);
/* Detaches the mount at `dir` lazily: containers may still hold bind mounts
 * of its files. 0, or -errno. */
int cgpu_region_unmount(const char *dir);
/* Moves the mount at `from` (a region made ahead of its instance) to `to`,
 * an empty directory; `from` is left an empty directory. 0, or -errno. */
int cgpu_region_move(const char *from, const char *to);

#endif
