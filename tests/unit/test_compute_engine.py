"""The compute scheduler's engine against real region files: the test plays
the tenant processes' side of the protocol in cgpu/region.h (demand, fence
acknowledgements, a process dying with its ledger), and checks what cgpud
does with the gates. libcgpu.so's side is tested in tests/intercept."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cgpud._region import ffi as rffi
from cgpud._region import lib as rlib
from cgpud.daemon.compute import MAX_TENANTS, ComputeError, ComputeScheduler
from cgpud.daemon.compute_policy import limits_compute
from cgpud.daemon.config import MAX_SCHEDULED
from cgpud.daemon.model import (ComputePolicy, ComputeTiming, Grant, Instance, InstanceState, NodeMode, NodePolicy,
                                Owner, OwnerKind)
from cgpud.daemon.region import GRANTS_FILE, DeviceLimit, InstanceLimits, UsageRegion, write_region

OPEN, UNGATED, SEQ = rlib.CGPU_GATE_OPEN, rlib.CGPU_GATE_UNGATED, rlib.CGPU_GATE_SEQ_MASK
FAST = ComputeTiming(period_ns=20_000_000, max_slice_ns=2_000_000, high_priority_percent=80)


def wait_until(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.0005)
    return cond()


class Tenant:
    """One instance's region, seen as its processes see it."""

    def __init__(self, root: Path, name: str, core: int) -> None:
        self.dir = root / name
        write_region(self.dir, InstanceLimits(name, (DeviceLimit("GPU-x", 1 << 30, 0, core),)), gated=True)
        self.instance = Instance(name, Owner(OwnerKind.PROCESS, name), (Grant(0, "GPU-x", 1 << 30, core),),
                                 InstanceState.RESERVED, True)
        fd = os.open(self.dir / GRANTS_FILE, os.O_RDONLY)
        self._gmap = mmap.mmap(fd, rffi.sizeof("struct cgpu_grants"), mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        self.grants = rffi.from_buffer("struct cgpu_grants *", self._gmap)
        self.usage = UsageRegion(self.dir)
        self.u = self.usage._mapped()

    @property
    def gate(self) -> int:
        return int(self.grants.device[0].gate)

    def want(self, waiting: int) -> None:
        self.u.device[0].waiting = waiting

    def watch(self) -> int:
        ledger = self.usage.claim(os.getpid())
        self.u.proc[ledger].watching = 1
        return ledger

    def ack(self, ledger: int, launched: bool = True) -> None:
        self.u.proc[ledger].fence_ack[0] = (self.gate & SEQ) | (rlib.CGPU_ACK_LAUNCHED if launched else 0)
        self.u.device[0].bell += 1

    def close(self) -> None:
        self.usage.close()
        del self.grants
        self._gmap.close()


def launching_process(region: Path, waiting: bool) -> subprocess.Popen[str]:
    """A real process with a ledger in the region's usage file that says it
    launches on device 0 (and, if `waiting`, waits at its gate); returns once
    it holds the ledger, so killing it leaves what a killed tenant leaves."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from cgpud.daemon.region import UsageRegion\n"
        f"r = UsageRegion({str(region)!r})\n"
        "u = r._mapped()\n"
        "i = r.claim(1)\n"
        "u.proc[i].watching = 1\n"
        f"u.device[0].waiting += {int(waiting)}\n"
        "print(i, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    int(child.stdout.readline())
    return child


@pytest.fixture
def sched() -> Iterator[ComputeScheduler]:
    s = ComputeScheduler(1, FAST).start()
    yield s
    s.stop()


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[Callable[[str, int], Tenant]]:
    made: list[Tenant] = []

    def make(name: str, core: int = 0) -> Tenant:
        made.append(Tenant(tmp_path, name, core))
        return made[-1]

    yield make
    for t in made:
        t.close()


def test_only_core_mem_nodes_limit_compute() -> None:
    assert limits_compute(NodeMode.CORE_MEM)
    assert not any(limits_compute(m) for m in (NodeMode.CGPU, NodeMode.SHARE, NodeMode.DEFAULT, NodeMode.MPS))
    assert MAX_SCHEDULED == MAX_TENANTS


def test_one_gpu_can_run_its_own_policy(sched: ComputeScheduler, tenants) -> None:
    two = ComputeScheduler(2, FAST).start()
    try:
        node = NodePolicy(compute_policy=ComputePolicy.FIXED, gpu_compute_policies=((1, ComputePolicy.NATIVE),))
        two.configure(node)
        assert two.schedule(0).policy is ComputePolicy.FIXED and two.schedule(1).policy is ComputePolicy.NATIVE
    finally:
        two.stop()


def test_regions_of_nodes_without_compute_limits_are_open_for_good(tmp_path: Path) -> None:
    write_region(tmp_path / "r", InstanceLimits("r", (DeviceLimit("GPU-x", 1 << 30, 0, 0),)), gated=False)
    raw = (tmp_path / "r" / GRANTS_FILE).read_bytes()
    g = rffi.from_buffer("struct cgpu_grants *", bytearray(raw))
    assert all(g.device[d].gate == UNGATED for d in range(rlib.CGPU_MAX_DEVICES))


def test_native_opens_every_gate_and_a_limiting_policy_closes_them(sched: ComputeScheduler, tenants) -> None:
    a = tenants("a", 30)
    assert a.gate & (OPEN | UNGATED) == 0  # a new region computes only once scheduled
    sched.configure(NodePolicy(compute_policy=ComputePolicy.NATIVE))
    sched.attach(a.instance, a.dir)
    assert wait_until(lambda: a.gate & UNGATED)
    sched.configure(NodePolicy(compute_policy=ComputePolicy.FIXED))
    assert wait_until(lambda: a.gate & (OPEN | UNGATED) == 0)


def test_a_waiting_tenant_is_granted_and_fenced_at_the_end_of_its_share(sched: ComputeScheduler, tenants) -> None:
    sched.configure(NodePolicy(compute_policy=ComputePolicy.FIXED))
    a = tenants("a", 30)
    sched.attach(a.instance, a.dir)
    ledger = a.watch()
    a.want(1)
    assert wait_until(lambda: a.gate & OPEN)
    opened = a.gate
    # 30 % of a 20 ms period: the gate closes within a period, and stays
    # closed (the daemon waits for the fence) until acknowledged.
    assert wait_until(lambda: a.gate & OPEN == 0, timeout=1)
    closed = a.gate
    assert closed & SEQ != opened & SEQ
    a.ack(ledger)
    assert wait_until(lambda: sched.schedule(0).fences >= 1)
    s = sched.schedule(0)
    assert s.fence_timeouts == 0 and s.tenants == 1


def test_an_unacknowledged_fence_times_out_and_the_next_tenant_runs(sched: ComputeScheduler, tenants) -> None:
    sched.configure(NodePolicy(compute_policy=ComputePolicy.PREEMPTIVE))
    a, b = tenants("a"), tenants("b")
    sched.attach(a.instance, a.dir)
    sched.attach(b.instance, b.dir)
    a.watch()  # a process that launches but never acknowledges (stopped, hung)
    a.want(1)
    b.want(1)
    holder_first = a if wait_until(lambda: a.gate & OPEN, timeout=0.2) else b
    assert wait_until(lambda: b.gate & OPEN and a.gate & OPEN == 0, timeout=2)
    assert holder_first is b or sched.schedule(0).fence_timeouts == 1


def test_a_tenant_killed_holding_the_gate_stalls_the_others_for_at_most_a_slice(
        sched: ComputeScheduler, tenants) -> None:
    sched.configure(NodePolicy(compute_policy=ComputePolicy.PREEMPTIVE))
    a, b = tenants("a"), tenants("b")
    # A real process claims a ledger in a's usage file, says it launches on
    # device 0, and is killed: its ledger lock goes with it.
    child = launching_process(a.dir, waiting=False)
    try:
        sched.attach(a.instance, a.dir)
        a.want(1)
        assert wait_until(lambda: a.gate & OPEN)
        child.kill()
        child.wait()
        a.want(0)
        sched.attach(b.instance, b.dir)
        b.want(1)
        started = time.monotonic()
        assert wait_until(lambda: b.gate & OPEN, timeout=2)
        stalled = time.monotonic() - started
    finally:
        child.kill()
        child.wait()
    s = sched.schedule(0)
    assert s.fence_timeouts == 0, "a dead process's ledger was waited for"
    # One 2 ms slice plus the lock probe and wake-ups; the fence timeout is 50 ms.
    assert stalled < 0.04, stalled


def test_detach_closes_the_gate_and_stop_opens_every_gate(tenants) -> None:
    s = ComputeScheduler(1, FAST).start()
    a, b = tenants("a", 50), tenants("b", 50)
    s.configure(NodePolicy(compute_policy=ComputePolicy.FIXED))
    s.attach(a.instance, a.dir)
    s.attach(b.instance, b.dir)
    a.want(1)
    assert wait_until(lambda: a.gate & OPEN)
    s.detach("a")
    assert a.gate & (OPEN | UNGATED) == 0
    assert s.schedule(0).tenants == 1
    s.stop()
    assert b.gate & UNGATED, "cgpud stopping must not leave processes waiting for a grant"


def test_bad_attachments_are_refused_and_change_nothing(sched: ComputeScheduler, tenants, tmp_path: Path) -> None:
    sched.configure(NodePolicy(compute_policy=ComputePolicy.FIXED))
    a, b = tenants("a", 70), tenants("b", 40)
    sched.attach(a.instance, a.dir)
    with pytest.raises(ComputeError, match="more than 100"):
        sched.attach(b.instance, b.dir)
    missing = Instance("gone", b.instance.owner, b.instance.grants, InstanceState.RESERVED, True)
    with pytest.raises(ComputeError, match=f"cannot open {tmp_path}/nowhere/grants"):
        sched.attach(missing, tmp_path / "nowhere")
    assert sched.schedule(0).tenants == 1


def test_waiting_left_by_a_process_killed_at_the_gate_stops_counting_as_demand(
        sched: ComputeScheduler, tenants) -> None:
    sched.configure(NodePolicy(compute_policy=ComputePolicy.PREEMPTIVE))
    a, b = tenants("a"), tenants("b")
    # A process waits at a's closed gate (counted in `waiting`) and is
    # killed there: nothing takes it off the count.
    child = launching_process(a.dir, waiting=True)
    child.kill()
    child.wait()
    sched.attach(a.instance, a.dir)
    sched.attach(b.instance, b.dir)
    b.want(1)
    opened: set[int] = set()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        g = a.gate
        if g & OPEN:
            opened.add(g & SEQ)
        time.sleep(0.0002)
    # One grant finds out nobody is there; with 2 ms slices a live waiter
    # would have had the GPU every other slice, about 75 times.
    assert len(opened) <= 2, len(opened)
    assert wait_until(lambda: b.gate & OPEN)


# ------------------------------------------------------------ sanitizers

ENGINE_DRIVER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cgpu/region.h"
#include "region.h"
#include "scheduler.h"
#include "engine.h"

#define N 4
static char dirs[N][600];
static atomic_int tenants_stop;
static unsigned long long rng = 88172645463325252ull;
static unsigned long long next_rand(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

static void *map(const char *dir, const char *name, size_t size, int *fd_out)
{
    char path[700];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) { perror(path); exit(10); }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(11); }
    if (fd_out) *fd_out = fd; else close(fd);
    return p;
}

static void write_file(const char *dir, const char *name, const void *data, size_t size)
{
    char path[700];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, data, size) != (ssize_t)size) { perror(path); exit(12); }
    close(fd);
}

/* libcgpu.so's side of the protocol, without a GPU: launch while open,
 * wait while closed, acknowledge every closing. */
static void *tenant(void *arg)
{
    int i = (int)(long)arg, fd;
    struct cgpu_usage *u = map(dirs[i], "usage", sizeof(*u), &fd);
    struct cgpu_grants *g = map(dirs[i], "grants", sizeof(*g), NULL);
    int ledger = cgpu_ledger_claim(u, fd, 1000 + i);
    if (ledger < 0) { fprintf(stderr, "no ledger\n"); exit(13); }
    atomic_fetch_or(&u->proc[ledger].watching, 1u);
    uint32_t acked = 0;
    int launched = 0;
    while (!atomic_load(&tenants_stop)) {
        uint32_t v = atomic_load(&g->device[0].gate);
        if (v & (CGPU_GATE_OPEN | CGPU_GATE_UNGATED)) {
            usleep(100);
            launched = 1;
            continue;
        }
        if ((v & CGPU_GATE_SEQ_MASK) != acked) {
            acked = v & CGPU_GATE_SEQ_MASK;
            atomic_store(&u->proc[ledger].fence_ack[0], acked | (launched ? CGPU_ACK_LAUNCHED : 0));
            launched = 0;
            atomic_fetch_add(&u->device[0].bell, 1);
            syscall(SYS_futex, (uint32_t *)&u->device[0].bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        }
        atomic_fetch_add(&u->device[0].waiting, 1);
        struct timespec ts = {0, 5000000};
        syscall(SYS_futex, (uint32_t *)&g->device[0].gate, FUTEX_WAIT, v, &ts, NULL, 0);
        atomic_fetch_sub(&u->device[0].waiting, 1);
    }
    munmap(g, sizeof(*g));
    munmap(u, sizeof(*u));
    close(fd);
    return NULL;
}

struct runner { struct cgpu_engine *e; unsigned gpu; };
static void *run_gpu(void *arg)
{
    struct runner *r = arg;
    if (cgpu_engine_run(r->e, r->gpu) != 0) { fprintf(stderr, "run refused\n"); exit(14); }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2) return 2;
    for (int i = 0; i < N; i++) {
        snprintf(dirs[i], sizeof(dirs[i]), "%s/r%d", argv[1], i);
        mkdir(dirs[i], 0755);
        struct cgpu_grants *g = calloc(1, sizeof(*g));
        struct cgpu_usage *u = calloc(1, sizeof(*u));
        g->magic = CGPU_GRANTS_MAGIC; g->version = CGPU_REGION_VERSION; g->size = sizeof(*g);
        u->magic = CGPU_USAGE_MAGIC; u->version = CGPU_REGION_VERSION; u->size = sizeof(*u);
        write_file(dirs[i], "grants", g, sizeof(*g));
        write_file(dirs[i], "usage", u, sizeof(*u));
        free(g);
        free(u);
    }
    struct cgpu_engine *e = cgpu_engine_create(2);
    if (!e || cgpu_engine_create(0) || cgpu_engine_create(CGPU_SCHED_MAX_GPUS + 1)) return 3;
    char err[256];
    pthread_t run[2], ten[N];
    struct runner rs[2] = {{e, 0}, {e, 1}};
    for (int i = 0; i < 2; i++) pthread_create(&run[i], NULL, run_gpu, &rs[i]);
    if (cgpu_engine_run(e, 2) == 0) return 4;
    for (long i = 0; i < N; i++) pthread_create(&ten[i], NULL, tenant, (void *)i);
    struct cgpu_engine_stats st;
    struct cgpu_sched_tenant_info info;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        unsigned long long r = next_rand();
        unsigned gpu = (unsigned)(r % 3);
        unsigned long long key = (r >> 4) % 10;
        const char *dir = (r >> 8) % 9 == 0 ? "/nonexistent" : dirs[(r >> 12) % N];
        int rc = 0;
        switch ((r >> 16) % 8) {
        case 0: rc = cgpu_engine_configure(e, gpu, (int)((r >> 20) % 8) - 1, 1000000ull + (r >> 24) % 300000000ull,
                                           1000ull + (r >> 32) % 30000000ull, (unsigned)(r >> 40) % 120); break;
        case 1: case 2: rc = cgpu_engine_attach(e, gpu, key, dir, (unsigned)((r >> 20) % 18) % 17 ? 0 : 1,
                                                (unsigned)(r >> 24) % 120, (unsigned)(r >> 32) % 120,
                                                (int)(r >> 40) % 2, err, sizeof(err)); break;
        case 3: rc = cgpu_engine_detach(e, gpu, key); break;
        case 4: rc = cgpu_engine_stats_get(e, gpu, (r >> 20) % 5 ? &st : NULL); break;
        case 5: rc = cgpu_engine_tenant_get(e, gpu, key, &info); break;
        default: usleep(500);
        }
        if (rc > 0) { fprintf(stderr, "bad status %d\n", rc); return 5; }
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000000000ll + (t.tv_nsec - t0.tv_nsec) < 2000000000ll);
    /* A known final state: every region attached under a fresh key, then stop. */
    for (int i = 0; i < N; i++) {
        cgpu_engine_configure(e, (unsigned)i % 2, CGPU_SCHED_PREEMPTIVE, 100000000ull, 5000000ull, 50);
        if (cgpu_engine_attach(e, (unsigned)i % 2, 100 + (unsigned)i, dirs[i], 0, 0, 1, 0, err, sizeof(err)) != 0) {
            fprintf(stderr, "final attach: %s\n", err);
            return 6;
        }
    }
    usleep(50000);
    cgpu_engine_stop(e);
    for (int i = 0; i < 2; i++) pthread_join(run[i], NULL);
    for (int i = 0; i < N; i++) {
        struct cgpu_grants *g = map(dirs[i], "grants", sizeof(*g), NULL);
        if (!(atomic_load(&g->device[0].gate) & CGPU_GATE_UNGATED)) { fprintf(stderr, "gate %d left shut\n", i); return 7; }
        munmap(g, sizeof(*g));
    }
    atomic_store(&tenants_stop, 1);
    for (int i = 0; i < N; i++) pthread_join(ten[i], NULL);
    for (unsigned gpu = 0; gpu < 2; gpu++)
        for (unsigned long long key = 0; key < 110; key++)
            cgpu_engine_detach(e, gpu, key);
    cgpu_engine_destroy(e);
    puts("ok");
    return 0;
}
"""


def test_engine_is_clean_under_asan_and_ubsan(tmp_path: Path) -> None:
    """Runner threads, tenant threads playing libcgpu's side, and random
    valid and invalid control calls, all at once, for 2 s."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "csrc"))
    import build_native

    driver = tmp_path / "engine_fuzz.c"
    driver.write_text(ENGINE_DRIVER)
    target = build_native.Target("bin/engine-fuzz", (str(driver), "scheduler/engine.c", "scheduler/scheduler.c",
                                                      "region/region.c"),
                                 libs=("-lpthread",), includes=("include", "scheduler", "region"))
    exe = build_native.compile_target(target, tmp_path, build_native.SANITIZE)
    (tmp_path / "regions").mkdir()
    env = {"ASAN_OPTIONS": "detect_leaks=1:exitcode=86", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87"}
    proc = subprocess.run([str(exe), str(tmp_path / "regions")], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert "runtime error" not in proc.stderr and "Sanitizer" not in proc.stderr
