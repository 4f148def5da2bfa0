/* The few system calls the start path's small programs make (the front,
 * runtime_front.c, and cgpu-hook), without libc where
 * CGPU_FRONT_FREESTANDING is defined (x86-64 and aarch64 release builds):
 * a glibc program's start-up alone cost about 0.4 ms an exec on the
 * machines measured, and these run on every container start. Elsewhere,
 * and in the sanitizer builds, the same calls go through libc. Every call
 * returns -errno on failure. Include once per program. */
#ifndef CGPU_HOOK_MINI_SYS_H
#define CGPU_HOOK_MINI_SYS_H

#include <stddef.h>

#if defined(CGPU_FRONT_FREESTANDING)
/* ---- system calls, without libc -------------------------------------------------------- */
#include <asm/stat.h>
#include <asm/unistd.h>
#include <linux/fcntl.h>
#include <linux/stat.h>

/* The generic Linux numbers, which x86-64 and aarch64 both use. */
#define E_NOENT 2
#define E_INTR 4
#define E_ACCES 13
#define E_NOTDIR 20

static inline long sys6(long n, long a, long b, long c, long d, long e, long f)
{
#if defined(__x86_64__)
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
#else
#error "CGPU_FRONT_FREESTANDING needs x86-64 or aarch64"
#endif
}

static inline int f_open(const char *path, int flags)
{
    return (int)sys6(__NR_openat, AT_FDCWD, (long)path, flags, 0, 0, 0);
}

static inline long f_read(int fd, char *buf, size_t n)
{
    return sys6(__NR_read, fd, (long)buf, (long)n, 0, 0, 0);
}

static inline void f_close(int fd)
{
    sys6(__NR_close, fd, 0, 0, 0, 0, 0);
}

/* 1 and the size if fd is a regular file, 0 if not, -1 on error. fstat,
 * not statx: kernels before 4.11 (CentOS 7's 3.10) have no statx, and an
 * unreadable config would send a GPU start to runc without its limits. */
static inline int f_regular(int fd, unsigned long long *size)
{
    struct stat st;
    if (sys6(__NR_fstat, fd, (long)&st, 0, 0, 0, 0) < 0)
        return -1;
    *size = (unsigned long long)st.st_size;
    return (st.st_mode & S_IFMT) == S_IFREG;
}

/* Returns only on failure: -errno. */
static inline int f_execve(const char *path, char *const *argv, char *const *envp)
{
    return (int)sys6(__NR_execve, (long)path, (long)argv, (long)envp, 0, 0, 0);
}

static inline long f_readlink(const char *path, char *buf, size_t n)
{
    return sys6(__NR_readlinkat, AT_FDCWD, (long)path, (long)buf, (long)n, 0, 0);
}

static inline void f_write(int fd, const char *buf, size_t n)
{
    sys6(__NR_write, fd, (long)buf, (long)n, 0, 0, 0);
}

static inline _Noreturn void f_exit(int code)
{
    for (;;)
        sys6(__NR_exit_group, code, 0, 0, 0, 0, 0);
}

/* The generic Linux values, which x86-64 and aarch64 both use. */
#define F_AF_UNIX 1
#define F_SOCK_STREAM 1
#define F_SOCK_NONBLOCK 04000 /* O_NONBLOCK */
#define F_MSG_NOSIGNAL 0x4000
#define F_SHUT_WR 1

/* A non-blocking unix stream socket, kept open across execve; -errno. */
static inline int f_unix_socket(void)
{
    return (int)sys6(__NR_socket, F_AF_UNIX, F_SOCK_STREAM | F_SOCK_NONBLOCK, 0, 0, 0, 0);
}

static inline int f_connect(int fd, const void *addr, size_t len)
{
    return (int)sys6(__NR_connect, fd, (long)addr, (long)len, 0, 0, 0);
}

static inline long f_send(int fd, const char *buf, size_t n)
{
    return sys6(__NR_sendto, fd, (long)buf, (long)n, F_MSG_NOSIGNAL, 0, 0);
}

static inline int f_shutdown_write(int fd)
{
    return (int)sys6(__NR_shutdown, fd, F_SHUT_WR, 0, 0, 0, 0);
}

#define OPEN_CONFIG (O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
#define OPEN_BUNDLE (O_PATH | O_DIRECTORY | O_CLOEXEC)

/* The compiler may call these for copies and zeroing; there is no libc to
 * provide them. */
void *memcpy(void *dst, const void *src, size_t n);
void *memset(void *dst, int c, size_t n);
void *memmove(void *dst, const void *src, size_t n);
int memcmp(const void *a, const void *b, size_t n);

void *memcpy(void *dst, const void *src, size_t n)
{
    return memmove(dst, src, n);
}

void *memmove(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s)
        for (size_t i = 0; i < n; i++)
            d[i] = s[i];
    else
        for (size_t i = n; i > 0; i--)
            d[i - 1] = s[i - 1];
    return dst;
}

void *memset(void *dst, int c, size_t n)
{
    unsigned char *d = dst;
    for (size_t i = 0; i < n; i++)
        d[i] = (unsigned char)c;
    return dst;
}

int memcmp(const void *a, const void *b, size_t n)
{
    const unsigned char *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return x[i] - y[i];
    return 0;
}

/* For cgpu-hook's relay client. */
#define E_AGAIN 11
#define E_PIPE 32
#define E_CONNRESET 104
#define E_CONNREFUSED 111
#define F_SOCK_CLOEXEC 02000000 /* O_CLOEXEC */
#define F_SOL_SOCKET 1
#define F_SO_RCVTIMEO 20 /* the long-based timeval ones, on both machines */
#define F_SO_SNDTIMEO 21

/* A blocking unix stream socket, closed on exec; -errno. */
static inline int f_unix_socket_blocking(void)
{
    return (int)sys6(__NR_socket, F_AF_UNIX, F_SOCK_STREAM | F_SOCK_CLOEXEC, 0, 0, 0, 0);
}

/* SO_RCVTIMEO or SO_SNDTIMEO of whole seconds; -errno. */
static inline int f_socket_timeout(int fd, int opt, long seconds)
{
    long tv[2] = {seconds, 0}; /* struct timeval: two longs on x86-64 and aarch64 */
    return (int)sys6(__NR_setsockopt, fd, F_SOL_SOCKET, opt, (long)tv, sizeof(tv), 0);
}

static inline long f_recv(int fd, char *buf, size_t n)
{
    return sys6(__NR_recvfrom, fd, (long)buf, (long)n, 0, 0, 0);
}

static inline long f_now_ms(void)
{
    long ts[2] = {0, 0};
    sys6(__NR_clock_gettime, 1 /* CLOCK_MONOTONIC */, (long)ts, 0, 0, 0, 0);
    return ts[0] * 1000L + ts[1] / 1000000L;
}

static inline void f_sleep_ms(long ms)
{
    long ts[2] = {ms / 1000, (ms % 1000) * 1000000L};
    while (sys6(__NR_nanosleep, (long)ts, (long)ts, 0, 0, 0, 0) == -E_INTR)
        ;
}

/* glibc's wording for the errors a relay can meet, so a message reads the
 * same whichever way the program was built. */
static inline const char *f_strerror(int err)
{
    switch (err) {
    case 1: return "Operation not permitted";
    case 2: return "No such file or directory";
    case 4: return "Interrupted system call";
    case 5: return "Input/output error";
    case 9: return "Bad file descriptor";
    case 11: return "Resource temporarily unavailable";
    case 12: return "Cannot allocate memory";
    case 13: return "Permission denied";
    case 14: return "Bad address";
    case 20: return "Not a directory";
    case 21: return "Is a directory";
    case 22: return "Invalid argument";
    case 23: return "Too many open files in system";
    case 24: return "Too many open files";
    case 32: return "Broken pipe";
    case 36: return "File name too long";
    case 40: return "Too many levels of symbolic links";
    case 88: return "Socket operation on non-socket";
    case 91: return "Protocol wrong type for socket";
    case 97: return "Address family not supported by protocol";
    case 104: return "Connection reset by peer";
    case 105: return "No buffer space available";
    case 107: return "Transport endpoint is not connected";
    case 110: return "Connection timed out";
    case 111: return "Connection refused";
    default: return NULL; /* the caller says "Unknown error N", as glibc does */
    }
}

#else
/* ---- the same calls through libc ------------------------------------------------------- */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

/* The raw call, -errno on failure, as the freestanding one: the calls both
 * halves share (below) are written once. */
static inline long sys6(long n, long a, long b, long c, long d, long e, long f)
{
    long r = syscall(n, a, b, c, d, e, f);
    return r == -1 ? -errno : r;
}

#define E_NOENT ENOENT
#define E_NOTDIR ENOTDIR
#define E_ACCES EACCES
#define E_INTR EINTR
#define OPEN_CONFIG (O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
#define OPEN_BUNDLE (O_PATH | O_DIRECTORY | O_CLOEXEC)

static inline int f_open(const char *path, int flags)
{
    int fd = open(path, flags);
    return fd < 0 ? -errno : fd;
}

static inline long f_read(int fd, char *buf, size_t n)
{
    ssize_t got = read(fd, buf, n);
    return got < 0 ? -errno : got;
}

static inline void f_close(int fd)
{
    close(fd);
}

static inline int f_regular(int fd, unsigned long long *size)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        return -1;
    *size = (unsigned long long)st.st_size;
    return S_ISREG(st.st_mode);
}

static inline int f_execve(const char *path, char *const *argv, char *const *envp)
{
    execve(path, argv, envp);
    return -errno;
}

static inline long f_readlink(const char *path, char *buf, size_t n)
{
    ssize_t got = readlink(path, buf, n);
    return got < 0 ? -errno : got;
}

static inline void f_write(int fd, const char *buf, size_t n)
{
    ssize_t done = write(fd, buf, n);
    (void)done; /* nowhere left to report it */
}

static inline _Noreturn void f_exit(int code)
{
    _exit(code);
}

#define F_AF_UNIX AF_UNIX

static inline int f_unix_socket(void)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    return fd < 0 ? -errno : fd;
}

static inline int f_connect(int fd, const void *addr, size_t len)
{
    return connect(fd, addr, (socklen_t)len) < 0 ? -errno : 0;
}

static inline long f_send(int fd, const char *buf, size_t n)
{
    ssize_t done = send(fd, buf, n, MSG_NOSIGNAL);
    return done < 0 ? -errno : done;
}

static inline int f_shutdown_write(int fd)
{
    return shutdown(fd, SHUT_WR) < 0 ? -errno : 0;
}

#include <time.h>

#define E_AGAIN EAGAIN
#define E_PIPE EPIPE
#define E_CONNRESET ECONNRESET
#define E_CONNREFUSED ECONNREFUSED
#define F_SO_RCVTIMEO SO_RCVTIMEO
#define F_SO_SNDTIMEO SO_SNDTIMEO

static inline int f_unix_socket_blocking(void)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    return fd < 0 ? -errno : fd;
}

static inline int f_socket_timeout(int fd, int opt, long seconds)
{
    struct timeval tv = {.tv_sec = seconds};
    return setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof(tv)) < 0 ? -errno : 0;
}

static inline long f_recv(int fd, char *buf, size_t n)
{
    ssize_t got = recv(fd, buf, n, 0);
    return got < 0 ? -errno : got;
}

static inline long f_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static inline void f_sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static inline const char *f_strerror(int err)
{
    return strerror(err);
}
#endif

/* ---- the front's streamed start (runtime_front.c), both halves ------------------------ */

#define F_SIGCHLD 17
#define F_SIGKILL 9
#define F_PR_SET_PDEATHSIG 1
#define F_SOL_SOCKET_RIGHTS 1 /* SOL_SOCKET */
#define F_SCM_RIGHTS 1
#define F_F_SETFD 2
#define F_S_IFIFO 0010000
#define F_S_IFMT 0170000
#define F_X_OK 1

/* The kernel's struct iovec, msghdr and one cmsghdr carrying one fd, as
 * on every 64-bit Linux (x86-64 and aarch64 alike). */
struct f_iovec {
    const void *base;
    size_t len;
};
struct f_msghdr {
    void *name;
    int namelen;
    struct f_iovec *iov;
    size_t iovlen;
    void *control;
    size_t controllen;
    unsigned flags;
};
struct f_cmsg_fd {
    size_t len;
    int level;
    int type;
    int fd;
    int pad; /* CMSG_SPACE(sizeof(int)) is 24 */
};

static inline int f_getpid(void)
{
    return (int)sys6(__NR_getpid, 0, 0, 0, 0, 0, 0);
}

static inline int f_getppid(void)
{
    return (int)sys6(__NR_getppid, 0, 0, 0, 0, 0, 0);
}

static inline int f_openat(int dir, const char *path, int flags, int mode)
{
    return (int)sys6(__NR_openat, dir, (long)path, flags, mode, 0, 0);
}

/* The file's type and permission bits (st_mode); -errno. */
static inline long f_mode(int fd)
{
    struct stat st;
#if defined(CGPU_FRONT_FREESTANDING)
    long r = sys6(__NR_fstat, fd, (long)&st, 0, 0, 0, 0);
#else
    long r = fstat(fd, &st) < 0 ? -errno : 0;
#endif
    return r < 0 ? r : (long)st.st_mode;
}

static inline int f_mkfifoat(int dir, const char *name, int mode)
{
    return (int)sys6(__NR_mknodat, dir, (long)name, F_S_IFIFO | mode, 0, 0, 0);
}

static inline int f_fchmod(int fd, int mode)
{
    return (int)sys6(__NR_fchmod, fd, mode, 0, 0, 0, 0);
}

static inline int f_renameat(int from_dir, const char *from, int to_dir, const char *to)
{
#if defined(__NR_renameat)
    return (int)sys6(__NR_renameat, from_dir, (long)from, to_dir, (long)to, 0, 0);
#else /* aarch64 has only renameat2 */
    return (int)sys6(__NR_renameat2, from_dir, (long)from, to_dir, (long)to, 0, 0);
#endif
}

static inline int f_unlinkat(int dir, const char *name)
{
    return (int)sys6(__NR_unlinkat, dir, (long)name, 0, 0, 0, 0);
}

static inline int f_cloexec(int fd, int on)
{
    return (int)sys6(__NR_fcntl, fd, F_F_SETFD, on, 0, 0, 0);
}

static inline int f_executable(const char *path)
{
    return sys6(__NR_faccessat, AT_FDCWD, (long)path, F_X_OK, 0, 0, 0) == 0;
}

/* `len` bytes of `buf` and one descriptor, in one non-blocking send. */
static inline long f_send_fd(int sock, const char *buf, size_t len, int fd)
{
    struct f_iovec iov = {buf, len};
    struct f_cmsg_fd cm = {.len = sizeof(size_t) + 2 * sizeof(int) + sizeof(int), .level = F_SOL_SOCKET_RIGHTS,
                           .type = F_SCM_RIGHTS, .fd = fd};
    struct f_msghdr msg = {.iov = &iov, .iovlen = 1, .control = &cm, .controllen = sizeof(cm)};
    _Static_assert(sizeof(struct f_cmsg_fd) == 24, "CMSG_SPACE(sizeof(int))");
    return sys6(__NR_sendmsg, sock, (long)&msg, 0x4000 /* MSG_NOSIGNAL */, 0, 0, 0);
}

/* fork(2): 0 in the child, its pid in the parent, -errno. clone with
 * SIGCHLD alone is fork on both machines (aarch64 has no fork call). The
 * libc build forks through libc, which the sanitizers follow. */
static inline long f_fork(void)
{
#if defined(CGPU_FRONT_FREESTANDING)
    return sys6(__NR_clone, F_SIGCHLD, 0, 0, 0, 0, 0);
#else
    pid_t pid = fork();
    return pid < 0 ? -errno : pid;
#endif
}

/* Dies with its parent: a front killed while runc waits takes runc along. */
static inline void f_die_with_parent(void)
{
    sys6(__NR_prctl, F_PR_SET_PDEATHSIG, F_SIGKILL, 0, 0, 0, 0);
}


#endif
