/* cgpud's side of the relay wire for the fuzz targets: a thread that
 * accepts one connection at a time, records the request to EOF, answers
 * the line the harness chose and closes. The relays under test reach it
 * only: connect() in them is routed through fuzz_guarded_connect, so no
 * input ever talks to a cgpud running on this machine.
 * Ownership: one static server per process. Thread-safety: the harness and
 * the server thread share fuzz_srv under its lock. */
#ifndef CGPU_FUZZ_SERVER_H
#define CGPU_FUZZ_SERVER_H

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "fuzz_input.h"

static struct {
    pthread_mutex_t lock;
    int served; /* connections answered so far */
    size_t len;
    const char *answer;
    char path[108];
    char buf[(1 << 20) + 64];
} fuzz_srv = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int fuzz_guarded_connect(int fd, const struct sockaddr *addr, socklen_t len)
{
    if (strcmp(((const struct sockaddr_un *)addr)->sun_path, fuzz_srv.path) != 0) {
        errno = ENOENT;
        return -1;
    }
    return connect(fd, addr, len);
}

static void *fuzz_serve(void *arg)
{
    int lfd = *(int *)arg;
    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0)
            continue;
        pthread_mutex_lock(&fuzz_srv.lock);
        size_t n = 0;
        for (;;) {
            ssize_t k = recv(c, fuzz_srv.buf + n, sizeof(fuzz_srv.buf) - n, 0);
            if (k <= 0)
                break;
            n += (size_t)k;
        }
        fuzz_srv.len = n;
        fuzz_srv.served++;
        send(c, fuzz_srv.answer, strlen(fuzz_srv.answer), MSG_NOSIGNAL);
        pthread_mutex_unlock(&fuzz_srv.lock);
        close(c);
    }
    return NULL;
}

static void fuzz_server_remove(void)
{
    unlink(fuzz_srv.path);
}

static void fuzz_server_start(const char *name)
{
    snprintf(fuzz_srv.path, sizeof(fuzz_srv.path), "/tmp/cgpu-fuzz-%s-%d.sock", name, (int)getpid());
    unlink(fuzz_srv.path);
    atexit(fuzz_server_remove);
    static int lfd;
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strcpy(addr.sun_path, fuzz_srv.path);
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&addr, sizeof(addr)) == 0 && listen(lfd, 4) == 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, fuzz_serve, &lfd) == 0);
}

/* Sets the next answer; returns how many requests were served so far. */
static int fuzz_server_arm(const char *answer)
{
    pthread_mutex_lock(&fuzz_srv.lock);
    fuzz_srv.answer = answer;
    int served = fuzz_srv.served;
    pthread_mutex_unlock(&fuzz_srv.lock);
    return served;
}

#endif
