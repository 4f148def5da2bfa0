/* old-kernel MAX_NR PROGRAM [ARG...]: runs PROGRAM as on a kernel that has
 * only the x86_64 system calls numbered up to MAX_NR. A seccomp filter,
 * inherited by every child, answers ENOSYS to the others, as an older
 * kernel does (its table simply ends there: on x86_64 new calls are
 * numbered after all older ones). 32-bit and x32 calls get ENOSYS too.
 * tests/harness/old_kernel.py builds it and names the kernels. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#define X32_BIT 0x40000000u

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: old-kernel MAX_NR PROGRAM [ARG...]\n");
        return 2;
    }
    char *end;
    unsigned long max_nr = strtoul(argv[1], &end, 10);
    if (*end != '\0' || max_nr == 0 || max_nr >= X32_BIT) {
        fprintf(stderr, "old-kernel: MAX_NR %s is not a system call number\n", argv[1]);
        return 2;
    }
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, (unsigned)max_nr, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    /* Without no_new_privs a setuid child would drop the filter's guarantee;
     * the kernel insists on it unless the caller has CAP_SYS_ADMIN. */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("old-kernel: seccomp");
        return 2;
    }
    execvp(argv[2], argv + 2);
    fprintf(stderr, "old-kernel: cannot run %s: %s\n", argv[2], strerror(errno));
    return 127;
}
