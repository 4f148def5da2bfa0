/* Opening and mapping one region file (region_file.h). */
#define _GNU_SOURCE
#include "region_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "path.h"

int cgpu_region_file_map(const char *dir, const char *name, int flags, size_t size, struct cgpu_region_file *f,
                         char *err, size_t errlen)
{
    char path[CGPU_REGION_PATH_MAX];
    if (!cgpu_join_path(path, sizeof(path), dir, name)) {
        snprintf(err, errlen, "region path %.200s.../%s is longer than %zu bytes", dir, name, sizeof(path) - 1);
        return -ENAMETOOLONG;
    }
    /* O_NONBLOCK: a FIFO put where a region file belongs would block open()
     * until a writer came; now it opens and fails at lseek (ESPIPE). On a
     * regular file the flag changes nothing, the locks included. */
    int fd = open(path, flags | O_CLOEXEC | O_NONBLOCK);
    /* The size by lseek, not fstat: fstat is a glibc 2.33 symbol, and images
     * with an older libc would skip libcgpu's preload (glibc_baseline.h). */
    off_t length = fd < 0 ? -1 : lseek(fd, 0, SEEK_END);
    if (fd < 0 || length < 0) {
        int rc = -errno;
        snprintf(err, errlen, "cannot open %.400s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return rc;
    }
    if (size && (size_t)length < size) {
        snprintf(err, errlen, "%.400s is not a cgpu region file of %zu bytes", path, size);
        close(fd);
        return -EINVAL;
    }
    size_t len = size ? size : (size_t)length;
    int prot = (flags & O_ACCMODE) == O_RDWR ? PROT_READ | PROT_WRITE : PROT_READ;
    /* An empty file maps nothing: mmap refuses a length of 0 with EINVAL. */
    void *p = mmap(NULL, len, prot, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int rc = -errno;
        snprintf(err, errlen, "cannot map %.400s (%zu bytes): %s", path, len, strerror(errno));
        close(fd);
        return rc;
    }
    *f = (struct cgpu_region_file){.addr = p, .size = len, .fd = fd};
    return 0;
}
