"""libcgpu.so gates kernel launches on the compute scheduler's grants
(csrc/include/cgpu/region.h): a closed gate holds every launch API, an open
or absent one lets launches through, closing a gate makes each process fence
its work in flight and acknowledge it, a grants file that cannot be trusted
refuses launches, and a forked child takes part on its own.

cgpud's scheduler is not in these tests: the test plays its part on the
grants file, storing gate words and waking the futex waiters as it would."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from cgpud._region import lib
from tests.harness.sim import write_sim_config
from tests.harness.simrun import sim_stat, start_py
from tests.harness.grants import GATE_UNGATED, GIB, closed, grants_bytes, opened
from tests.harness.wait import until

ACK_LAUNCHED = int(lib.CGPU_ACK_LAUNCHED)
APIS = ["kernel", "ex", "cooperative", "graph", "launch", "grid", "grid-async", "multi-device"]
STREAMS = pytest.mark.parametrize("per_thread", [False, True], ids=["legacy-stream", "per-thread-stream"])
EVERY_API = pytest.mark.parametrize("api", APIS)


def busy_ns(native: Path, env: dict[str, str], pid: int, gpu: int = 0) -> int:
    """Device time the simulated GPU has given (or queued for) `pid`."""
    for p in sim_stat(native, env)["procs"]:
        if p["pid"] == pid:
            return p["busy_ns"][gpu]
    return 0


def busy_between(native: Path, env: dict[str, str], pid: int, start: int, end: int, gpu: int = 0) -> int:
    got = sim_stat(native, env, "--busy", str(gpu), str(start), str(end))
    return int(got["per_pid"].get(str(pid), 0))


def start_burn(native: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(native / "bin" / "cgpu-burn"), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def burn_to_the_end(native: Path, env: dict[str, str], *args: str) -> tuple[int, dict, list[str]]:
    """cgpu-burn run to its end whatever its exit code: the code, its JSON
    report and the lines of its stderr."""
    proc = subprocess.run(
        [str(native / "bin" / "cgpu-burn"), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    return proc.returncode, json.loads(proc.stdout), proc.stderr.strip().splitlines()


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out)


def stream_args(api: str, per_thread: bool) -> list[str]:
    return [f"--launch-api={api}", *(["--per-thread-stream"] if per_thread else [])]


@STREAMS
@EVERY_API
def test_a_closed_gate_holds_every_launch_until_it_opens(native, sim_env, gated, api, per_thread):
    env, region = gated([closed(1)])
    t0 = time.monotonic_ns()
    proc = start_burn(native, env, *stream_args(api, per_thread), "--launches=8", "--kernel-ns=200000")
    try:
        # Blocked in its first launch, counted as demand, nothing on the device.
        until(lambda: region.waiting() >= 1, 5.0, interval=0.005, what="a thread waiting at the gate")
        until(
            lambda: region.fence_ack(proc.pid) == closed(1),
            5.0,
            interval=0.005,
            what="the fence watcher's first acknowledgement",
        )
        time.sleep(0.2)
        assert proc.poll() is None
        assert busy_ns(native, env, proc.pid) == 0
        assert region.watching(proc.pid) == 1
        region.set_gate(0, opened(2))
        out = finish(proc)
    finally:
        proc.kill()
    assert out["errors"] == [] and out["launches"] == 8
    assert region.waiting() == 0
    # It all ran, once the gate was open.
    assert busy_between(native, sim_env, proc.pid, t0, time.monotonic_ns()) == 8 * 200000


@pytest.mark.parametrize("grants", ["ungated", "no-grants-file"])
@EVERY_API
def test_without_compute_control_launches_run_freely(native, gated, grants, api):
    env, region = gated([GATE_UNGATED] if grants == "ungated" else None)
    out = finish(
        start_burn(native, env, f"--launch-api={api}", "--launches=20", "--kernel-ns=10000", "--per-thread-stream")
    )
    assert out["errors"] == [] and out["launches"] == 20
    if region is not None:
        assert region.waiting() == 0 and region.usage.proc[0].watching == 0  # no watcher, nothing to fence


@STREAMS
@EVERY_API
def test_closing_the_gate_fences_the_work_in_flight(native, sim_env, gated, api, per_thread):
    env, region = gated([opened(1)])
    proc = start_burn(
        native, env, *stream_args(api, per_thread), "--duration=1.5", "--kernel-ns=2000000", "--streams=2"
    )
    try:
        until(lambda: busy_ns(native, env, proc.pid) > 0, 5.0, interval=0.005, what="device work")
        assert region.watching(proc.pid) == 1
        time.sleep(0.1)
        bell = region.bell()
        region.set_gate(0, closed(2))
        until(
            lambda: region.fence_ack(proc.pid) == closed(2) | ACK_LAUNCHED,
            3,
            interval=0.005,
            what="the fence acknowledgement",
        )
        acked = time.monotonic_ns()
        assert region.bell() > bell
        # Everything it had queued was done by the time it said so...
        assert busy_between(native, sim_env, proc.pid, acked, acked + 60 * 10**9) == 0
        # ...and nothing more reaches the device while the gate stays closed.
        before = busy_ns(native, env, proc.pid)
        time.sleep(0.3)
        assert busy_ns(native, env, proc.pid) == before
        assert region.waiting() >= 1
        region.set_gate(0, opened(3))
        out = finish(proc)
    finally:
        proc.kill()
    assert out["errors"] == []


@pytest.mark.parametrize("damage", ["magic", "version", "truncated"])
def test_a_grants_file_that_cannot_be_trusted_refuses_launches(native, gated, damage):
    good = bytearray(grants_bytes([opened(1)]))
    if damage == "magic":
        good[0] ^= 0xFF
    elif damage == "version":
        good[8] = 1
    else:
        good = good[:64]
    env, _ = gated(bytes(good))
    code, out, lines = burn_to_the_end(native, env, "--alloc-until-fail=1GiB", "--launches=3", "--kernel-ns=1000")
    assert code == 1
    assert out["errors"] == [{"call": "cuLaunchKernel", "result": "CUDA_ERROR_NOT_PERMITTED"}]
    assert out["launches"] == 0
    # Memory limits hold as ever.
    assert out["alloc"]["until_fail_count"] == 4 and out["mem_total_reported"] == 4 * GIB
    assert len(lines) == 1 and "compute grants unavailable" in lines[0] and "grants" in lines[0]


def test_a_broken_region_with_grants_refuses_launches_too(native, gated):
    env, _ = gated(grants_bytes([opened(1)]))
    limits = Path(env["CGPU_REGION_DIR"]) / "limits"
    data = bytearray(limits.read_bytes())
    data[200] ^= 0xFF
    limits.chmod(0o644)
    limits.write_bytes(bytes(data))
    _, out, lines = burn_to_the_end(native, env, "--alloc=1MiB", "--launches=2")
    assert out["alloc"]["results"] == ["CUDA_ERROR_OUT_OF_MEMORY"]
    assert out["errors"] == [{"call": "cuLaunchKernel", "result": "CUDA_ERROR_NOT_PERMITTED"}]
    assert len(lines) == 1 and "allocations and kernel launches will fail" in lines[0]


def test_each_gpu_of_an_instance_has_its_own_gate(native, tmp_path, sim_env, gated):
    # Three GPUs; the instance holds GPU 1 (slot 0) and GPU 0 (slot 1), not GPU 2.
    sim = dict(sim_env, CGPU_SIM_CONFIG=str(write_sim_config(tmp_path / "three.conf", gpus=3)))
    env, region = gated([opened(1), closed(1)], gpus=(1, 0), env=sim)
    args = ["--launches=4", "--kernel-ns=10000"]
    assert finish(start_burn(native, env, "--device=1", *args))["errors"] == []
    assert finish(start_burn(native, env, "--device=2", *args))["errors"] == []  # not the instance's to gate
    held = start_burn(native, env, "--device=0", *args)
    try:
        until(lambda: region.waiting(1) >= 1, 5.0, interval=0.005, what="a launch waiting at GPU 0's gate")
        assert region.waiting(0) == 0 and held.poll() is None
        assert region.watching(held.pid) == 2  # bit 1: slot 1
        region.set_gate(1, opened(2))
        assert finish(held)["errors"] == []
    finally:
        held.kill()


FORKER = """
import json, os, sys; from cudapy import Driver
cu = Driver(); cu.init_device(0); fn = cu.spin_function()
cu.launch_spin(fn, 1000000); cu.call("cuCtxSynchronize")
print("parent", flush=True)
pid = os.fork()
if pid == 0:
    child = Driver(); child.init_device(0); fn = child.spin_function()
    child.launch_spin(fn, 1000000); child.call("cuCtxSynchronize")
    print("child", os.getpid(), flush=True)
    sys.stdin.readline()
    for _ in range(5):
        child.launch_spin(fn, 1000000)
    child.call("cuCtxSynchronize")
    print("child-done", flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(json.dumps(status), flush=True)
"""


def test_a_forked_child_fences_and_waits_on_its_own(native, gated):
    env, region = gated([opened(1)])
    proc = start_py(env, FORKER)
    try:
        assert proc.stdout.readline().strip() == "parent"
        word, child = proc.stdout.readline().split()
        child = int(child)
        assert word == "child"
        # Two ledgers, each with its own watcher.
        assert region.watching(proc.pid) == 1 and region.watching(child) == 1
        assert region.ledger(proc.pid) != region.ledger(child)
        region.set_gate(0, closed(2))
        for pid in (proc.pid, child):
            until(
                lambda pid=pid: region.fence_ack(pid) == closed(2) | ACK_LAUNCHED,
                5.0,
                interval=0.005,
                what=f"{pid}'s fence",
            )
        busy = busy_ns(native, env, child)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        until(lambda: region.waiting() >= 1, 5.0, interval=0.005, what="the child waiting at the gate")
        time.sleep(0.1)
        assert busy_ns(native, env, child) == busy
        region.set_gate(0, opened(3))
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out.split() == ["child-done", "0"], err
    assert region.waiting() == 0


def test_a_closed_gate_nobody_drives_lets_launches_through_until_the_gate_moves(native, sim_env, gated):
    """cgpud's lock on the grants file gone (cgpud died): a thread waiting at
    the closed gate finds out within the probe interval and launches
    ungated; a new gate word (a restarted cgpud) gates it again."""
    env, region = gated([closed(1)])
    proc = start_burn(native, env, "--duration=30", "--kernel-ns=100000")
    try:
        until(lambda: region.waiting() >= 1, 5.0, interval=0.005, what="a thread waiting at the gate")
        assert busy_ns(native, env, proc.pid) == 0
        region.drive(False)
        until(lambda: busy_ns(native, env, proc.pid) > 0, 10, interval=0.005, what="launches past the orphaned gate")
        until(lambda: region.waiting() == 0, 5.0, interval=0.005, what="nobody left waiting")
        region.drive(True)
        region.set_gate(0, closed(2))
        until(lambda: region.fence_ack(proc.pid) >> 2 == 2, 5.0, interval=0.005, what="the fence of the new closing")
        until(lambda: region.waiting() >= 1, 5.0, interval=0.005, what="a thread waiting at the new gate")
        held = busy_ns(native, env, proc.pid)
        time.sleep(0.5)  # past the probe interval: the lock is held, so it keeps waiting
        assert busy_ns(native, env, proc.pid) == held
        region.set_gate(0, opened(3))
        until(lambda: busy_ns(native, env, proc.pid) > held, 5.0, interval=0.005, what="launches after the opening")
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert err.count("compute scheduler (cgpud) is gone") == 1, err


MULTI_DEVICE = """
import ctypes as C, sys; from cudapy import Driver
class Params(C.Structure):
    _fields_ = [("function", C.c_void_p), *((n, C.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "shmem")),
                ("stream", C.c_void_p), ("params", C.c_void_p)]
cu = Driver(); cu.call("cuInit", 0)
arg = C.c_uint64(10000)
argv = (C.c_void_p * 1)(C.cast(C.pointer(arg), C.c_void_p))
launches = (Params * 2)()
for dev in range(2):
    ctx, stream = C.c_void_p(), C.c_void_p()
    cu.call("cuDevicePrimaryCtxRetain", C.byref(ctx), dev)
    cu.call("cuCtxSetCurrent", ctx)
    cu.call("cuStreamCreate", C.byref(stream), 0)
    launches[dev] = Params(cu.spin_function(), 1, 1, 1, 1, 1, 1, 0, stream, C.cast(argv, C.c_void_p))
print(cu.rc("cuLaunchCooperativeKernelMultiDevice", launches, 2, 0), flush=True)
"""


@pytest.mark.parametrize("gates", ["gated", "ungated"])
def test_a_cooperative_grid_over_two_gated_gpus_is_refused(native, tmp_path, sim_env, gated, gates):
    """A thread waits at one gate at a time: a multi-device launch over two
    GPUs under compute control is refused (NOT_SUPPORTED), not let through
    ungated; without compute control it runs."""
    words = [opened(1), opened(1)] if gates == "gated" else [GATE_UNGATED, GATE_UNGATED]
    env, _ = gated(words, gpus=(0, 1))
    proc = start_py(env, MULTI_DEVICE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == ("CUDA_ERROR_NOT_SUPPORTED" if gates == "gated" else "CUDA_SUCCESS"), err


def test_what_a_process_has_queued_when_its_gate_closes_is_bounded(native, tmp_path, sim_env, gated):
    """A GPU whose launch queue holds a second of work, as a real push buffer
    can, and a process that never synchronises: when its gate closes, at
    most 128 launches (here 12.8 ms) are left to run into the next slice."""
    deep = dict(sim_env, CGPU_SIM_CONFIG=str(write_sim_config(tmp_path / "deep.conf", extra="queue_us=1000000")))
    env, region = gated([opened(1)], env=deep)
    proc = start_burn(native, env, "--duration=3", "--kernel-ns=100000", "--streams=1", "--sync-every=1000000000")
    try:
        until(lambda: busy_ns(native, env, proc.pid) > 0, 5.0, interval=0.005, what="device work")
        time.sleep(0.3)
        region.set_gate(0, closed(2))
        closed_at = time.monotonic_ns()
        until(lambda: region.fence_ack(proc.pid) == closed(2) | ACK_LAUNCHED, 10, interval=0.005, what="the fence")
        queued = busy_between(native, deep, proc.pid, closed_at, closed_at + 60 * 10**9)
        region.set_gate(0, opened(3))
        out = finish(proc)
    finally:
        proc.kill()
    assert out["errors"] == []
    # 128 launches of 100 us, and the few that raced the closing.
    assert queued <= 16_000_000, queued


PERIOD_NS = 100_000_000
WINDOW_NS = 30_000_000


@pytest.mark.timing  # a measured 30 % share, which a process short of CPU cannot fill
@pytest.mark.parametrize("gate", ["closed", "open"])
def test_a_gate_nobody_drives_keeps_the_process_to_its_window(native, sim_env, gated, gate: str) -> None:
    """cgpud gone under `fixed` (issue 39): the grants file names the
    instance's window (30 ms of every 100 ms), and the process launches only
    in it, whether it was waiting at a closed gate or held an open one whose
    slice ended long ago (its watcher finds cgpud gone). The simulated GPU
    says when each of its kernels ran: nearly all in the window, about 30 %
    of the time. A new gate word (cgpud back) ends the pacing."""
    env, region = gated([closed(1) if gate == "closed" else opened(1)])
    d = region.grants.device[0]
    d.alone_start_ns, d.alone_len_ns, d.alone_period_ns = 0, WINDOW_NS, PERIOD_NS
    d.slice_end_ns = 0  # an open gate's slice ended long ago
    proc = start_burn(native, env, "--duration=30", "--kernel-ns=200000", "--streams=2")
    try:
        if gate == "closed":
            until(lambda: region.waiting() >= 1, 5.0, interval=0.005, what="a thread waiting at the gate")
        else:
            until(lambda: busy_ns(native, env, proc.pid) > 0, 10, interval=0.005, what="launches at the open gate")
        region.drive(False)
        time.sleep(0.5)  # noticed (50 ms at a closed gate, 100 ms past the slice at an open one) and settled
        start = time.monotonic_ns()
        time.sleep(2.0)
        end = time.monotonic_ns()
        share = 100.0 * busy_between(native, env, proc.pid, start, end) / (end - start)
        assert 22 <= share <= 38, share
        # Outside the window (here 40-95 ms of each period, leaving room for
        # the queue's overrun) the process's kernels hardly ran.
        outside = 0
        for k in range(start // PERIOD_NS + 1, end // PERIOD_NS - 1):
            outside += busy_between(native, env, proc.pid, k * PERIOD_NS + 40_000_000, k * PERIOD_NS + 95_000_000)
        periods = end // PERIOD_NS - 1 - (start // PERIOD_NS + 1)
        assert outside <= periods * 2_000_000, (outside, periods)
        region.drive(True)
        region.set_gate(0, opened(2))
        paced = busy_ns(native, env, proc.pid)
        time.sleep(1.0)
        # The whole GPU again (about 1 s of it; more than half even when
        # the machine's two cores are shared with a dozen other processes).
        assert busy_ns(native, env, proc.pid) - paced > 500_000_000
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert err.count("kernel launches keep to the instance's share until it is back") == 1, err
