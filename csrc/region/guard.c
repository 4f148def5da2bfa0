/* The SIGBUS guard (guard.h). */
#define _GNU_SOURCE
#include "guard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

enum { SLOT_FREE = 0, SLOT_FILLING = 1, SLOT_LIVE = 2 };

struct slot {
    _Atomic int state;
    _Atomic uintptr_t start;
    _Atomic size_t len;
    _Atomic int damaged;
};

static struct slot slots[CGPU_GUARD_SLOTS];
static struct sigaction previous;
static pthread_once_t installed = PTHREAD_ONCE_INIT;
static int install_rc;

/* Hands the signal on as if we had never been installed. */
static void chain(int sig, siginfo_t *si, void *ctx)
{
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction)
            previous.sa_sigaction(sig, si, ctx);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* Default action. A fault repeats when we return and now kills; a
     * SIGBUS sent by kill() would not, so raise it (pending until we return). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (si->si_code <= 0)
        raise(sig);
}

static void on_sigbus(int sig, siginfo_t *si, void *ctx)
{
    int saved = errno;
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; si->si_code > 0 && i < CGPU_GUARD_SLOTS; i++) {
        struct slot *s = &slots[i];
        if (atomic_load_explicit(&s->state, memory_order_acquire) != SLOT_LIVE)
            continue;
        uintptr_t start = atomic_load_explicit(&s->start, memory_order_relaxed);
        size_t len = atomic_load_explicit(&s->len, memory_order_relaxed);
        if (a < start || a - start >= len)
            continue;
        /* mmap is a plain system call here, safe in a handler. Writes land
         * in private pages: the file is not ours to fix from here. */
        void *p = mmap((void *)start, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (p != MAP_FAILED) {
            atomic_store_explicit(&s->damaged, 1, memory_order_release);
            errno = saved;
            return;
        }
        break;
    }
    errno = saved;
    chain(sig, si, ctx);
}

static void install_once(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    install_rc = sigaction(SIGBUS, &sa, &previous) == 0 ? 0 : -errno;
}

int cgpu_guard_install(void)
{
    pthread_once(&installed, install_once);
    return install_rc;
}

int cgpu_guard_register(void *addr, size_t len)
{
    if (!addr || !len || cgpu_guard_install() != 0)
        return -1;
    for (int i = 0; i < CGPU_GUARD_SLOTS; i++) {
        int expect = SLOT_FREE;
        if (!atomic_compare_exchange_strong(&slots[i].state, &expect, SLOT_FILLING))
            continue;
        atomic_store(&slots[i].start, (uintptr_t)addr);
        atomic_store(&slots[i].len, len);
        atomic_store(&slots[i].damaged, 0);
        atomic_store_explicit(&slots[i].state, SLOT_LIVE, memory_order_release);
        return i;
    }
    return -1;
}

void cgpu_guard_unregister(int handle)
{
    if (handle >= 0 && handle < CGPU_GUARD_SLOTS)
        atomic_store_explicit(&slots[handle].state, SLOT_FREE, memory_order_release);
}

int cgpu_guard_damaged(int handle)
{
    if (handle < 0 || handle >= CGPU_GUARD_SLOTS)
        return 0;
    return atomic_load_explicit(&slots[handle].damaged, memory_order_acquire);
}
