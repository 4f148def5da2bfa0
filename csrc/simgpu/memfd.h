/* memfd_create through its system call: glibc declares it only from 2.27,
 * and the packages are built for 2.17 (docs/install.md). Kernels before 3.17
 * have none (-1, ENOSYS): the simulation then fails IPC and VMM exports
 * with CUDA_ERROR_OPERATING_SYSTEM. Thread-safe; the caller owns the fd. */
#ifndef CGPU_SIM_MEMFD_H
#define CGPU_SIM_MEMFD_H

#include <sys/syscall.h>
#include <unistd.h>

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033 /* F_LINUX_SPECIFIC_BASE + 9 */
#define F_GET_SEALS 1034
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#define F_SEAL_WRITE 0x0008
#endif

static inline int sim_memfd(const char *name, unsigned int flags)
{
    return (int)syscall(__NR_memfd_create, name, flags);
}

#endif
