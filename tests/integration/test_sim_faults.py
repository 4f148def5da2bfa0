"""Faults of the simulated GPUs as NVML and CUDA programs see them: XIDs
through NVML's event API (pynvml and raw ctypes), a GPU off the bus
(GPU_IS_LOST, CUDA_ERROR_UNKNOWN) and its reset. Faults are injected from
another process, by `cgpuctl sim fault` or cgpu-sim-stat, as an operator or
a test would."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.harness.simrun import PYNVML, run_py, sim_stat, start_py


def nvml(sim_env: dict[str, str], body: str) -> object:
    """Run `body` with pynvml initialised; return the JSON value it prints."""
    return run_py(sim_env, PYNVML + "n.nvmlInit()\n" + textwrap.dedent(body))


def fault(sim_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`cgpuctl sim fault ARGS` on the test's machine."""
    return subprocess.run(
        [sys.executable, "-m", "cgpud.cli.main", "sim", "fault", *args],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def inject(sim_env: dict[str, str], *args: str) -> None:
    proc = fault(sim_env, *args)
    assert proc.returncode == 0, proc.stderr


def test_each_event_set_sees_each_xid_posted_after_it_registered_once(native, sim_env):
    inject(sim_env, "--gpu", "1", "--xid", "61")  # before anyone registered: seen by no one
    waiter = start_py(
        sim_env,
        PYNVML
        + textwrap.dedent("""
        n.nvmlInit()
        s = n.nvmlEventSetCreate()
        hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        for h in hs:
            n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, s)
        print("ready", flush=True)
        sys.stdin.readline()
        got = []
        while True:
            try:
                d = n.nvmlEventSetWait(s, 300)
            except n.NVMLError_Timeout:
                break
            got.append([hs.index(next(h for h in hs if addr(h) == addr(d.device))), d.eventType, d.eventData,
                        d.gpuInstanceId, d.computeInstanceId])
        n.nvmlEventSetFree(s)
        print(json.dumps(got))
    """),
    )
    try:
        assert waiter.stdout.readline().strip() == "ready"
        # A second process's set, registered later, sees only what follows.
        inject(sim_env, "--gpu", "0", "--xid", "48")
        late = nvml(
            sim_env,
            f"""
            s = xid_set(1)
            subprocess.run(["{native / "bin" / "cgpu-sim-stat"}", "--xid", "1", "94"], check=True, capture_output=True)
            d = n.nvmlEventSetWait(s, 5000)
            print(json.dumps([d.eventData, err(lambda: n.nvmlEventSetWait(s, 0))]))
        """,
        )
        assert late == [94, "NVMLError_Timeout"]
        out, errs = waiter.communicate("go\n", timeout=30)
    finally:
        waiter.kill()
    xid = 8  # nvmlEventTypeXidCriticalError
    assert json.loads(out) == [[0, xid, 48, 0xFFFFFFFF, 0xFFFFFFFF], [1, xid, 94, 0xFFFFFFFF, 0xFFFFFFFF]], errs


def test_a_wait_wakes_when_another_process_posts_and_times_out_otherwise(native, sim_env):
    got = nvml(
        sim_env,
        f"""
        s = xid_set(0)
        t = time.monotonic()
        timeout = err(lambda: n.nvmlEventSetWait_v2(s, 250))
        waited = time.monotonic() - t
        poster = subprocess.Popen(["sh", "-c", "sleep 0.3; exec {native / "bin" / "cgpu-sim-stat"} --xid 0 119"],
                                  stdout=subprocess.DEVNULL)
        t = time.monotonic()
        d = n.nvmlEventSetWait_v2(s, 10000)
        woke = time.monotonic() - t
        poster.wait()
        print(json.dumps([timeout, waited, d.eventData, woke]))
    """,
    )
    timeout, waited, xid, woke = got
    assert timeout == "NVMLError_Timeout" and 0.24 <= waited < 1.0
    assert xid == 119 and 0.25 <= woke < 2.0  # woken by the post, not by the 10 s timeout


def test_a_set_that_falls_behind_gets_the_latest_xids(native, sim_env):
    got = nvml(
        sim_env,
        f"""
        s = xid_set(1)
        for x in range(1, 71):
            subprocess.run(["{native / "bin" / "cgpu-sim-stat"}", "--xid", "1", str(x)], check=True,
                           capture_output=True)
        print(json.dumps(drain(s)))
    """,
    )
    assert got == list(range(7, 71))  # the ring keeps the last 64


def test_a_lost_gpu_answers_gpu_is_lost_until_reset(native, sim_env):
    script = PYNVML + textwrap.dedent("""
        n.nvmlInit()
        h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        uuid = n.nvmlDeviceGetUUID(h[1])
        s = n.nvmlEventSetCreate()
        for x in h:
            n.nvmlDeviceRegisterEvents(x, n.nvmlEventTypeXidCriticalError, s)
        print("ready", flush=True)
        sys.stdin.readline()
        d = n.nvmlEventSetWait(s, 5000)
        lost = {
            "event": [addr(d.device) == addr(h[1]), d.eventData],
            "wait": err(lambda: n.nvmlEventSetWait(s, 5000)),
            "count": n.nvmlDeviceGetCount(),
            "by_index": err(lambda: n.nvmlDeviceGetHandleByIndex(1)),
            "by_uuid": err(lambda: n.nvmlDeviceGetHandleByUUID(uuid)),
            "memory": err(lambda: n.nvmlDeviceGetMemoryInfo(h[1])),
            "name": err(lambda: n.nvmlDeviceGetName(h[1])),
            "utilization": err(lambda: n.nvmlDeviceGetUtilizationRates(h[1])),
            "processes": err(lambda: n.nvmlDeviceGetComputeRunningProcesses(h[1])),
            "register": err(lambda: n.nvmlDeviceRegisterEvents(h[1], n.nvmlEventTypeXidCriticalError, s)),
            "other_gpu": err(lambda: n.nvmlDeviceGetMemoryInfo(h[0])),
        }
        print(json.dumps(lost), flush=True)
        sys.stdin.readline()
        back = {
            "memory": err(lambda: n.nvmlDeviceGetMemoryInfo(h[1])),
            "by_uuid": err(lambda: n.nvmlDeviceGetHandleByUUID(uuid)),
            "wait": err(lambda: n.nvmlEventSetWait(s, 0)),
        }
        print(json.dumps(back), flush=True)
    """)
    proc = start_py(sim_env, script)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        inject(sim_env, "--gpu", "1", "--lost")
        assert sim_stat(native, sim_env)["gpus"][1]["lost"] is True
        proc.stdin.write("\n")
        proc.stdin.flush()
        lost = json.loads(proc.stdout.readline())
        inject(sim_env, "--gpu", "1", "--recover")
        proc.stdin.write("\n")
        proc.stdin.flush()
        back = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    is_lost = "NVMLError_GpuIsLost"
    assert lost == {
        "event": [True, 79],
        "wait": is_lost,
        "count": 2,
        "by_index": is_lost,
        "by_uuid": is_lost,
        "memory": is_lost,
        "name": is_lost,
        "utilization": is_lost,
        "processes": is_lost,
        "register": is_lost,
        "other_gpu": "ok",
    }
    assert back == {"memory": "ok", "by_uuid": "ok", "wait": "NVMLError_Timeout"}
    assert sim_stat(native, sim_env)["gpus"][1]["lost"] is False


def test_cuda_fails_on_a_lost_gpu_and_a_context_from_before_the_loss_stays_broken(native, sim_env):
    script = """
        import ctypes as C, json, sys
        from cudapy import Driver
        d = Driver()
        ctx = d.init_device(0)
        print(json.dumps(d.alloc(1 << 20)[0]), flush=True)
        sys.stdin.readline()  # GPU 0 is lost
        new = C.c_void_p()
        lost = [d.alloc(1 << 20)[0], d.rc("cuCtxCreate_v2", C.byref(new), 0, 0)]
        print(json.dumps(lost), flush=True)
        sys.stdin.readline()  # GPU 0 is back
        old = d.alloc(1 << 20)[0]
        d.call("cuCtxCreate_v2", C.byref(new), 0, 0)  # a fresh context, current now
        print(json.dumps([old, d.alloc(1 << 20)[0]]), flush=True)
    """
    proc = start_py(sim_env, script)
    try:
        assert json.loads(proc.stdout.readline()) == "CUDA_SUCCESS", proc.stderr.read()
        inject(sim_env, "--gpu", "0", "--lost")
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == ["CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN"]
        inject(sim_env, "--gpu", "0", "--recover")
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == ["CUDA_ERROR_UNKNOWN", "CUDA_SUCCESS"]
    finally:
        proc.kill()
        proc.wait()


def test_raw_abi_event_calls_check_their_arguments(native, sim_env):
    got = run_py(
        sim_env,
        """
        import ctypes as C, json
        lib = C.CDLL("libnvidia-ml.so.1")
        class Data(C.Structure):
            _fields_ = [("device", C.c_void_p), ("eventType", C.c_ulonglong), ("eventData", C.c_ulonglong),
                        ("gpuInstanceId", C.c_uint), ("computeInstanceId", C.c_uint)]
        before = lib.nvmlEventSetCreate(C.byref(C.c_void_p()))
        assert lib.nvmlInit_v2() == 0
        h, s = C.c_void_p(), C.c_void_p()
        assert lib.nvmlDeviceGetHandleByIndex_v2(0, C.byref(h)) == 0
        out = {"before_init": before, "create_null": lib.nvmlEventSetCreate(None),
               "create": lib.nvmlEventSetCreate(C.byref(s))}
        types = C.c_ulonglong()
        out["supported"] = [lib.nvmlDeviceGetSupportedEventTypes(h, C.byref(types)), types.value]
        out["supported_null"] = lib.nvmlDeviceGetSupportedEventTypes(h, None)
        out["register_unsupported"] = lib.nvmlDeviceRegisterEvents(h, C.c_ulonglong(0x100), s)
        out["register_null_set"] = lib.nvmlDeviceRegisterEvents(h, C.c_ulonglong(8), None)
        out["register"] = lib.nvmlDeviceRegisterEvents(h, C.c_ulonglong(8), s)
        data = Data()
        out["wait_null_data"] = lib.nvmlEventSetWait_v2(s, None, 0)
        out["wait_null_set"] = lib.nvmlEventSetWait_v2(None, C.byref(data), 0)
        out["wait_timeout"] = lib.nvmlEventSetWait_v2(s, C.byref(data), 0)
        out["free_null"] = lib.nvmlEventSetFree(None)
        out["free"] = lib.nvmlEventSetFree(s)
        print(json.dumps(out))
    """,
    )
    assert got == {
        "before_init": 1,
        "create_null": 2,
        "create": 0,
        "supported": [0, 0x1F],
        "supported_null": 2,
        "register_unsupported": 3,
        "register_null_set": 2,
        "register": 0,
        "wait_null_data": 2,
        "wait_null_set": 2,
        "wait_timeout": 10,
        "free_null": 2,
        "free": 0,
    }


def test_the_legacy_wait_writes_only_the_pre_mig_fields(native, sim_env):
    got = run_py(
        sim_env,
        f"""
        import ctypes as C, json, subprocess
        lib = C.CDLL("libnvidia-ml.so.1")
        assert lib.nvmlInit_v2() == 0
        h, s = C.c_void_p(), C.c_void_p()
        assert lib.nvmlDeviceGetHandleByIndex_v2(0, C.byref(h)) == 0
        assert lib.nvmlEventSetCreate(C.byref(s)) == 0
        assert lib.nvmlDeviceRegisterEvents(h, C.c_ulonglong(8), s) == 0
        subprocess.run(["{native / "bin" / "cgpu-sim-stat"}", "--xid", "0", "74"], check=True, capture_output=True)
        buf = (C.c_ubyte * 32)(*([0xAB] * 32))
        rc = lib.nvmlEventSetWait(s, buf, 5000)
        fields = (C.c_ulonglong * 3).from_buffer(buf)
        print(json.dumps([rc, fields[0] == h.value, fields[1], fields[2], list(buf[24:])]))
    """,
    )
    assert got == [0, True, 8, 74, [0xAB] * 8]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "2", "--xid", "48"], "no GPU 2: the machine has 2"),
        (["--gpu", "0", "--xid", "1000"], "--xid must be between 1 and 999, got 1000"),
        (["--gpu", "-1", "--lost"], "--gpu must be 0 or more, got -1"),
    ],
)
def test_a_bad_fault_is_refused_with_a_reason_and_changes_nothing(native, sim_env, args, message):
    proc = fault(sim_env, *args)
    assert proc.returncode == 1 and proc.stderr.strip().endswith(message), proc.stderr
    assert all(g["xids"] == 0 and g["lost"] is False for g in sim_stat(native, sim_env)["gpus"])


def test_cgpu_sim_stat_fault_modes_report_the_gpu(native, sim_env):
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(native / "bin" / "cgpu-sim-stat"), *args], env=sim_env, capture_output=True, text=True, timeout=30
        )

    assert json.loads(run("--xid", "1", "999").stdout) == {"index": 1, "lost": False, "xids": 1}
    assert json.loads(run("--lost", "1").stdout) == {"index": 1, "lost": True, "xids": 2}
    assert json.loads(run("--recover", "1").stdout) == {"index": 1, "lost": False, "xids": 2}
    for bad in (["--xid", "1", "0"], ["--xid", "1"], ["--lost"], ["--recover", "x"]):
        proc = run(*bad)
        assert proc.returncode == 2 and proc.stderr.startswith("usage: cgpu-sim-stat"), bad
