/* Exercises csrc/region/guard.c as a tenant would attack cgpud: a mapped
 * file truncated under the mapping. Built with ASan and UBSan by
 * test_guard.py. Exit 0: every check held; the message names the first that
 * did not. Mode "unguarded" faults on a mapping nobody registered (the test
 * expects the previous handler, then death by SIGBUS). */
#define _GNU_SOURCE
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "guard.h"

#define PAGES 4

static volatile sig_atomic_t previous_ran;

static void previous_handler(int sig)
{
    (void)sig;
    previous_ran = 1;
    static const char msg[] = "previous handler\n";
    if (write(2, msg, sizeof(msg) - 1) < 0) {
    }
    signal(SIGBUS, SIG_DFL); /* the fault repeats and kills, as a real handler would let it */
}

static unsigned char *map_file(size_t len, int *fd_out)
{
    char path[] = "/tmp/cgpu-guard-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0 || unlink(path) != 0 || ftruncate(fd, (off_t)len) != 0)
        return NULL;
    unsigned char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return NULL;
    memset(p, 0xab, len);
    *fd_out = fd;
    return p;
}

static int fail(const char *what)
{
    fprintf(stderr, "guard_driver: %s\n", what);
    return 1;
}

int main(int argc, char **argv)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), len = PAGES * page;
    struct sigaction sa = {.sa_handler = previous_handler};
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0)
        return fail("cannot install the previous handler");
    if (cgpu_guard_install() != 0)
        return fail("cannot install the guard");
    int fd, other_fd;
    unsigned char *p = map_file(len, &fd), *other = map_file(len, &other_fd);
    if (!p || !other)
        return fail("cannot map the test files");

    if (argc > 1 && strcmp(argv[1], "unguarded") == 0) {
        if (ftruncate(other_fd, 0) != 0)
            return fail("cannot truncate");
        volatile unsigned char v = other[page];
        (void)v;
        return fail("an unguarded fault went unnoticed");
    }

    int h = cgpu_guard_register(p, len);
    if (h < 0 || cgpu_guard_damaged(h))
        return fail("register");
    if (ftruncate(fd, (off_t)page) != 0) /* the tenant keeps the first page */
        return fail("cannot truncate");
    volatile unsigned char *vp = p;
    if (vp[2 * page + 1] != 0) /* past the end: zeros, not SIGBUS */
        return fail("a read past the truncated end is not zero");
    if (!cgpu_guard_damaged(h))
        return fail("the mapping is not marked damaged");
    vp[3 * page] = 7; /* writes land in private pages */
    if (vp[3 * page] != 7 || vp[0] != 0)
        return fail("the replaced range is not plain zeroed memory");
    if (previous_ran)
        return fail("a guarded fault reached the previous handler");
    _Atomic unsigned *word = (_Atomic unsigned *)(p + page);
    atomic_fetch_add(word, 1); /* the engine's atomics on the replaced pages */
    if (atomic_load(word) != 1)
        return fail("atomic on the replaced pages");

    /* A slot freed and taken again starts undamaged. */
    cgpu_guard_unregister(h);
    int h2 = cgpu_guard_register(other, len);
    if (h2 < 0 || cgpu_guard_damaged(h2))
        return fail("a re-used slot is still damaged");
    cgpu_guard_unregister(h2);
    munmap(p, len);
    munmap(other, len);
    close(fd);
    close(other_fd);
    puts("ok");
    return 0;
}
