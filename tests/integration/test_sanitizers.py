"""Every C part built with AddressSanitizer and UndefinedBehaviorSanitizer,
then exercised: the workload on the simulated driver through each
allocation and launch path, the state dump, and the relays."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.harness import sanitizers
from tests.harness.sanitizers import run_clean
from tests.harness.simrun import PYNVML
from tests.harness.wait import until

BURNS = {
    "alloc-until-fail": ["--alloc-until-fail=1GiB"],
    "pitch": ["--alloc-api=pitch", "--alloc=1GiB"],
    "managed": ["--alloc-api=managed", "--alloc=1GiB"],
    "async": ["--alloc-api=async", "--alloc=1GiB"],
    "pool": ["--alloc-api=pool", "--alloc=1GiB"],
    "vmm": ["--alloc-api=vmm", "--alloc=1GiB"],
    "array": ["--alloc-api=array", "--alloc=1GiB"],
    "kernels": ["--launches=50", "--kernel-ns=20000", "--streams=3", "--events"],
    "ex": ["--launch-api=ex", "--launches=20", "--kernel-ns=20000", "--per-thread-stream"],
    "cooperative": ["--launch-api=cooperative", "--launches=20", "--kernel-ns=20000", "--resolve=dlsym"],
    "graph": ["--launch-api=graph", "--launches=20", "--kernel-ns=20000", "--events"],
}


@pytest.mark.parametrize("case", sorted(BURNS))
def test_workload_and_driver_are_clean_under_sanitizers(san_native, san_env, case):
    proc = run_clean([str(san_native / "bin" / "cgpu-burn"), *BURNS[case]], san_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["errors"] == []


def test_state_dump_is_clean_under_sanitizers(san_native, san_env):
    run_clean([str(san_native / "bin" / "cgpu-burn"), "--launches=5", "--kernel-ns=1000"], san_env)
    proc = run_clean([str(san_native / "bin" / "cgpu-sim-stat")], san_env)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["gpus"]) == 2


def test_faults_and_nvml_events_are_clean_under_sanitizers(san_native, san_env):
    """XIDs, a lost GPU and its reset injected by the sanitized cgpu-sim-stat;
    the sanitized libnvidia-ml.so.1's event sets, waits and lost-GPU answers
    driven by pynvml in a Python that preloads the ASan runtime."""
    stat = str(san_native / "bin" / "cgpu-sim-stat")
    py_env = sanitizers.python_env(san_env)
    script = (
        PYNVML
        + f"""
n.nvmlInit()
h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
s = n.nvmlEventSetCreate()
for x in h:
    n.nvmlDeviceRegisterEvents(x, n.nvmlDeviceGetSupportedEventTypes(x), s)
for x in range(1, 80):
    subprocess.run(["{stat}", "--xid", str(x % 2), str(x)], check=True, capture_output=True)
got = drain(s)
subprocess.run(["{stat}", "--lost", "1"], check=True, capture_output=True)
lost = [n.nvmlEventSetWait(s, 100).eventData]
for f in (lambda: n.nvmlEventSetWait(s, 100), lambda: n.nvmlDeviceGetMemoryInfo(h[1])):
    try:
        f()
    except n.NVMLError_GpuIsLost:
        lost.append("lost")
subprocess.run(["{stat}", "--recover", "1"], check=True, capture_output=True)
n.nvmlEventSetFree(s)
n.nvmlShutdown()
print(json.dumps([len(got), lost]))
"""
    )
    proc = run_clean([sys.executable, "-c", script], py_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [79, [79, "lost", "lost"]]
    proc = run_clean([stat], san_env)
    assert [g["xids"] for g in json.loads(proc.stdout)["gpus"]] == [39, 41]
    assert run_clean([stat, "--xid", "0", "1000"], san_env).returncode == 2


def test_mig_nvml_cuda_and_libcgpu_are_clean_under_sanitizers(san_native, tmp_path):
    """A GPU in MIG mode: the sanitized NVML's MIG and instance queries, the
    sanitized driver on a MIG device, and the sanitized libcgpu.so holding
    that MIG device to 2 GiB."""
    from cgpud.node.region import DeviceLimit, InstanceLimits, write_region
    from tests.harness.sim import sim_env_in

    env = sanitizers.san_env(
        sim_env_in(tmp_path / "mig", Path(str(san_native)), mem="80GiB", placements=["mig=3g.40gb,1g.10gb"]),
        san_native,
    )
    script = (
        PYNVML
        + """
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
out = []
for i in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
    out.append(err(lambda: n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)))
m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)
a = n.nvmlDeviceGetAttributes(m)
p = n.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)
n.nvmlShutdown()
print(json.dumps([out, a.multiprocessorCount, p.id]))
"""
    )
    proc = run_clean([sys.executable, "-c", script], sanitizers.python_env(env))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["ok", "ok"] + ["NVMLError_NotFound"] * 5, 16, 19]
    # The layout changed at run time: MIG mode on GPU 1, an instance made and taken down again.
    admin = """
import ctypes as C, json
lib = C.CDLL("libnvidia-ml.so.1"); assert lib.nvmlInit_v2() == 0
h = C.c_void_p(); lib.nvmlDeviceGetHandleByIndex_v2(1, C.byref(h))
s = C.c_int(); gi = C.c_void_p(); ci = C.c_void_p(); m = C.c_void_p()
rcs = [lib.nvmlDeviceSetMigMode(h, 1, C.byref(s)), lib.nvmlDeviceCreateGpuInstance(h, 0, C.byref(gi)),
       lib.nvmlGpuInstanceCreateComputeInstance(gi, 4, C.byref(ci)),
       lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 0, C.byref(m)),
       lib.nvmlComputeInstanceDestroy(ci), lib.nvmlGpuInstanceDestroy(gi), lib.nvmlDeviceSetMigMode(h, 0, C.byref(s))]
print(json.dumps(rcs))
"""
    proc = run_clean([sys.executable, "-c", admin], sanitizers.python_env(env))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [0] * 7
    uuid = "MIG-5c1a0000-0000-4000-8000-000000a1000b"  # the 1g.10gb at slice 4: GPU instance 11
    burn = str(san_native / "bin" / "cgpu-burn")
    plain = run_clean([burn, "--alloc-until-fail=1GiB"], dict(env, CUDA_VISIBLE_DEVICES=uuid))
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["alloc"]["until_fail_count"] == 9  # 9984 MiB
    write_region(tmp_path / "region", InstanceLimits("san-mig", (DeviceLimit(uuid, 2 << 30, 0),)))
    limited = dict(
        env,
        CUDA_VISIBLE_DEVICES=uuid,
        LD_PRELOAD=f"{sanitizers.asan_runtime()}:{san_native / 'lib' / 'libcgpu.so'}",
        CGPU_REGION_DIR=str(tmp_path / "region"),
    )
    proc = run_clean([burn, "--alloc-until-fail=256MiB"], limited)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mem_total_reported"] == 2 << 30 and out["alloc"]["until_fail_count"] == 8


# The relays (cgpu-runtime, cgpu-hook) run every case of tests/relay under
# sanitizers too.


@pytest.mark.parametrize("case", ["alloc-until-fail", "pitch", "async", "pool", "vmm", "array", "kernels", "graph"])
def test_interception_library_is_clean_under_sanitizers(san_native, san_instance, case):
    args = BURNS[case] if case != "alloc-until-fail" else ["--alloc-until-fail=256MiB"]
    proc = run_clean([str(san_native / "bin" / "cgpu-burn"), *args], san_instance)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["errors"] == [] and out["mem_total_reported"] == 2 << 30
    if case == "alloc-until-fail":
        assert out["alloc"]["until_fail_count"] == 8


@contextmanager
def _gated_burn(san_native: Path, env: dict[str, str], *args: str) -> Iterator[tuple[subprocess.Popen[str], Any]]:
    """cgpu-burn started behind a closed gate, with a view of its grants for
    the block to drive; then it must finish sanitizer-clean with no error."""
    from tests.harness.grants import GATE_SEQ_STEP, GrantsView, grants_bytes, write_grants

    region = Path(env["CGPU_REGION_DIR"])
    write_grants(region, grants_bytes([GATE_SEQ_STEP]))
    view = GrantsView(region)
    proc = subprocess.Popen(
        [str(san_native / "bin" / "cgpu-burn"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, view
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        view.close()
    assert "Sanitizer" not in err and "runtime error" not in err, err
    assert proc.returncode == 0, err
    assert json.loads(out)["errors"] == []


@pytest.mark.parametrize("api", ["kernel", "graph", "grid-async"])
def test_gated_launches_are_clean_under_sanitizers(san_native, san_instance, api):
    """A closed gate, an opening, a closing with a fence, a reopening: the
    waiting path, the fence watcher thread and the open path, sanitized."""
    from cgpud._region import lib
    from tests.harness.grants import GATE_OPEN, GATE_SEQ_STEP

    with _gated_burn(
        san_native,
        san_instance,
        f"--launch-api={api}",
        "--duration=1.5",
        "--kernel-ns=1000000",
        "--per-thread-stream",
        "--streams=2",
    ) as (proc, view):
        until(lambda: view.waiting() >= 1, 10.0, interval=0.005, what="a launch waiting at the gate")
        view.set_gate(0, 2 * GATE_SEQ_STEP | GATE_OPEN)
        until(lambda: view.waiting() == 0, 10.0, interval=0.005, what="launches")
        time.sleep(0.2)
        view.set_gate(0, 3 * GATE_SEQ_STEP)
        until(
            lambda: view.fence_ack(proc.pid) == 3 * GATE_SEQ_STEP | lib.CGPU_ACK_LAUNCHED,
            10.0,
            interval=0.005,
            what="the fence",
        )
        view.set_gate(0, 4 * GATE_SEQ_STEP | GATE_OPEN)


def test_a_gate_orphaned_by_a_dead_cgpud_is_clean_under_sanitizers(san_native, san_instance):
    """The bounded wait, the lock probe, launching past the orphaned gate and
    being gated again by a new gate word, sanitized."""
    from tests.harness.grants import GATE_OPEN, GATE_SEQ_STEP

    with _gated_burn(san_native, san_instance, "--duration=1.5", "--kernel-ns=100000", "--streams=2") as (_, view):
        until(lambda: view.waiting() >= 1, 10.0, interval=0.005, what="a launch waiting at the gate")
        view.drive(False)
        until(lambda: view.waiting() == 0, 10.0, interval=0.005, what="launches past the orphaned gate")
        view.drive(True)
        view.set_gate(0, 2 * GATE_SEQ_STEP)
        until(lambda: view.waiting() >= 1, 10.0, interval=0.005, what="a launch waiting at the new gate")
        view.set_gate(0, 3 * GATE_SEQ_STEP | GATE_OPEN)


def test_mps_daemon_server_and_clients_are_clean_under_sanitizers(san_native, san_env, tmp_path):
    """The sanitized nvidia-cuda-mps-control (in the foreground, so its and
    its server's reports reach a file), its commands, two sanitized clients
    at 30 and 70 %, a pinned memory limit, and the sanitized libcgpu's MPS
    environment check in a client of an instance; then quit."""
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    logs.mkdir()
    env = dict(san_env, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    control = str(san_native / "sim" / "nvidia-cuda-mps-control")
    burn = str(san_native / "bin" / "cgpu-burn")
    with open(tmp_path / "daemon.err", "w") as err:
        daemon = subprocess.Popen([control, "-f"], env=dict(env, CUDA_VISIBLE_DEVICES="0"), stderr=err)
    try:
        until(lambda: (pipe / "control").exists(), timeout=30, what="the control socket")
        assert run_clean([control], env, stdin="set_default_active_thread_percentage 80\n").stdout == "80.0\n"
        clients = [
            subprocess.Popen(
                [burn, "--launches=40", "--kernel-ns=200000", "--streams=2"],
                env=dict(env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=pct),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for pct in ("30", "70")
        ]
        for c in clients:
            out, errs = c.communicate(timeout=120)
            sanitizers.assert_clean(errs)
            assert c.returncode == 0 and json.loads(out)["errors"] == [], errs
        limited = run_clean([burn, "--alloc-until-fail=256MiB"], dict(env, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1G"))
        assert limited.returncode == 0 and json.loads(limited.stdout)["alloc"]["until_fail_count"] <= 4
        inst = sanitizers.instance_env(env, san_native, tmp_path / "region")
        assert run_clean([burn, "--launches=2", "--kernel-ns=1000"], inst).returncode == 0
        server = run_clean([control], env, stdin="get_server_list\n").stdout.split()
        assert len(server) == 1
        run_clean([control], env, stdin="quit\n")
        assert daemon.wait(timeout=60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=30)
    sanitizers.assert_clean((tmp_path / "daemon.err").read_text())
