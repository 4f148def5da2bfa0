"""The NVML tools people run, nvitop and gpustat (both from PyPI, the test
extra), on the simulated GPUs: bare they show the machine without an error,
and inside an instance (`cgpuctl run --mem 1GiB`) they show the instance's
1 GiB as the GPU's memory and its own processes, never a neighbour's.

A process on the GPU is cgpu-burn holding memory and running kernels."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.nvml_clients import ERROR_TEXT, GPUSTAT, NVITOP, burner, check_inside, inside_argv
from tests.harness.simrun import PYNVML

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_native  # noqa: E402

GPU_NAME = "H100 80GB HBM3"

pytestmark = pytest.mark.skipif(
    not (NVITOP.exists() and GPUSTAT.exists()),
    reason="nvitop or gpustat is not installed (both are in the test extra)",
)


def _run_tool(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not ERROR_TEXT.search(out), out
    return proc.stdout


def nvitop(env: dict[str, str]) -> str:
    # A wide terminal: nvitop cuts command names to the width it is given.
    return _run_tool([str(NVITOP), "--once"], dict(env, COLUMNS="160"))


def gpustat(env: dict[str, str]) -> str:
    return _run_tool([str(GPUSTAT), "--no-color", "--show-cmd", "--show-pid", "--show-power", "--show-codec"], env)


def test_nvitop_bare_shows_the_gpus_and_a_running_process(native, sim_env):
    with burner(sim_env, native, "1GiB") as burn:
        out = nvitop(sim_env)
    assert out.count(GPU_NAME) == 2
    assert out.count("/ 16384MiB") == 2
    assert "1024MiB / 16384MiB" in out
    assert re.search(rf"^│\s+0\s+{burn.pid}\s+C\s+\S+\s+1024MiB", out, re.MULTILINE), out
    # Power, temperature, P-state, persistence, MIG and ECC are values, not N/A.
    assert out.count("W / 700W") == 2 and "P0" in out and "Disabled" in out
    assert re.search(r"\d+C\s+P0", out), out


def test_gpustat_bare_shows_the_gpus_and_a_running_process(native, sim_env):
    with burner(sim_env, native, "1GiB") as burn:
        out = gpustat(sim_env)
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and all(f"NVIDIA {GPU_NAME}" in line for line in lines), out
    assert re.search(r"\b1024 /\s+16384 MB", lines[0]) and re.search(r"\b0 /\s+16384 MB", lines[1]), out
    assert f"cgpu-burn/{burn.pid}(1024M)" in lines[0], out
    assert "??" not in out  # temperature, utilisation and power were all read
    assert re.search(r"\d+ / 700 W", lines[0]), out


# nvmlDeviceGetRunningProcessDetailList's size protocol, bare, straight
# through ctypes: asked with no room, with too little, then with enough.
DETAIL_LIST = """
import ctypes, json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
fn = n._nvmlGetFunctionPointer("nvmlDeviceGetRunningProcessDetailList")
def call(mode, room, version=n.nvmlProcessDetailList_v1):
    array = (n.c_nvmlProcessDetail_v1_t * max(room, 1))()
    plist = n.c_nvmlProcessDetailList_v1_t(version=version, mode=mode, numProcArrayEntries=room,
                                           procArray=array if room else None)
    rc = fn(h, ctypes.byref(plist))
    return [rc, plist.numProcArrayEntries,
            sorted([p.pid, p.usedGpuMemory >> 20] for p in array[:plist.numProcArrayEntries] if rc == 0)]
print(json.dumps({"sizes": [call(0, 0), call(0, 1), call(0, 8), call(3, 8)],
                  "none": [call(1, 0), call(2, 0)], "bad": [call(0, 8, version=0), call(4, 8)]}))
"""


def test_detail_list_bare_lists_every_process_with_its_memory(native, sim_env):
    with burner(sim_env, native, "1GiB") as one, burner(sim_env, native, "256MiB") as two:
        got = json.loads(
            subprocess.run(
                [sys.executable, "-c", DETAIL_LIST], env=sim_env, capture_output=True, text=True, timeout=60, check=True
            ).stdout
        )
    both = sorted([[one.pid, 1024], [two.pid, 256]])
    # INSUFFICIENT_SIZE (7) with the count needed; compute and "all" list both.
    assert got["sizes"] == [[7, 2, []], [7, 2, []], [0, 2, both], [0, 2, both]], got
    assert got["none"] == [[0, 0, []], [0, 0, []]], got  # no graphics contexts, no MPS clients
    assert got["bad"] == [[2, 8, []], [2, 8, []]], got  # a bad version or mode is INVALID_ARGUMENT


def test_inside_an_instance_both_tools_show_its_limit_and_only_its_processes(daemon, native, sim_env):
    # The neighbour runs outside any instance on the same GPU; 1 GiB instance
    # on a 2-GPU machine: binpack puts it on GPU 0, where the neighbour is.
    with burner(daemon.env, native, "2GiB") as neighbour:
        proc = daemon.cgpuctl(
            "run",
            "--mem",
            "1GiB",
            "--",
            *inside_argv(sys.executable, str(native / "bin/cgpu-burn")),
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    check_inside(proc.stdout, neighbour.pid)


def test_the_tools_nvml_paths_are_clean_under_sanitizers(tmp_path, native, sim_env):
    """The same run over the simulated NVML and libcgpu.so built with ASan and
    UBSan, preloaded into the tools' Python (an instance made from a region
    alone: no daemon)."""
    from cgpud.node.region import DeviceLimit, InstanceLimits, write_region

    san = tmp_path / "san"
    for target in build_native.TARGETS:
        if target.output in ("sim/libnvidia-ml.so.1", "lib/libcgpu.so"):
            build_native.compile_target(target, san, build_native.SANITIZE)
    shutil.copy(native / "sim/libcuda.so.1", san / "sim/libcuda.so.1")
    uuid = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pynvml as n; n.nvmlInit(); print(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(0)))",
        ],
        env=sim_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    write_region(tmp_path / "region", InstanceLimits("san", (DeviceLimit(uuid, 1 << 30, 0),)))
    asan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout
    env = dict(
        sim_env,
        LD_LIBRARY_PATH=str(san / "sim"),
        CGPU_REGION_DIR=str(tmp_path / "region"),
        # The ASan runtime first; Python itself leaks at exit by design.
        LD_PRELOAD=f"{asan.strip()}:{san / 'lib/libcgpu.so'}",
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87",
    )
    with burner(sim_env, native, "2GiB") as neighbour:
        proc = subprocess.run(
            inside_argv(sys.executable, str(native / "bin/cgpu-burn")),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_inside(proc.stdout, neighbour.pid)


MONITOR = (
    PYNVML
    + """
n.nvmlInit()
def state(i):
    h = n.nvmlDeviceGetHandleByIndex(i)
    return {
        "temp": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
        "power": n.nvmlDeviceGetPowerUsage(h),
        "sm_clock": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
        "util": n.nvmlDeviceGetUtilizationRates(h).gpu,
    }
h = n.nvmlDeviceGetHandleByIndex(1)
print(json.dumps({
    "busy": state(0), "idle": state(1),
    "fixed": [n.nvmlDeviceGetComputeMode(h), n.nvmlDeviceGetPersistenceMode(h), n.nvmlDeviceGetDisplayActive(h),
              n.nvmlDeviceGetDisplayMode(h), n.nvmlDeviceGetPerformanceState(h), n.nvmlDeviceGetEccMode(h),
              n.nvmlDeviceGetMigMode(h), n.nvmlDeviceIsMigDeviceHandle(h).value,
              n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
              n.nvmlDeviceGetPowerManagementLimit(h), n.nvmlDeviceGetEnforcedPowerLimit(h),
              n.nvmlDeviceGetPowerManagementLimitConstraints(h), n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
              n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM), n.nvmlDeviceGetEncoderUtilization(h),
              n.nvmlDeviceGetDecoderUtilization(h), n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES),
              [n.nvmlDeviceGetCurrPcieLinkGeneration(h), n.nvmlDeviceGetCurrPcieLinkWidth(h)],
              n.nvmlDeviceGetBAR1MemoryInfo(h).bar1Total >> 30],
    "errors": [err(lambda: n.nvmlDeviceGetFanSpeed(h)), err(lambda: n.nvmlDeviceGetClockInfo(h, 7)),
               err(lambda: n.nvmlDeviceGetTemperature(h, 5)),
               err(lambda: n.nvmlDeviceGetTotalEccErrors(h, 2, 0))],
}))
"""
)


def test_monitoring_queries_answer_like_a_data_centre_gpu(native, sim_env):
    with burner(sim_env, native, "64MiB"):
        out = subprocess.run(
            [sys.executable, "-c", MONITOR], env=sim_env, capture_output=True, text=True, timeout=60, check=True
        ).stdout
    got = json.loads(out)
    assert got["idle"] == {"temp": 32, "power": 70000, "sm_clock": 345, "util": 0}
    busy = got["busy"]
    assert busy["util"] > 0 and busy["sm_clock"] == 1980
    # Each query reads utilisation at its own moment: linear in some share above 0.
    assert 32 < busy["temp"] <= 72 and 70000 < busy["power"] <= 700000 and (busy["power"] - 70000) % 6300 == 0
    assert got["fixed"] == [
        0,
        1,
        0,
        0,
        0,
        [1, 1],
        [0, 0],
        0,
        0,
        700000,
        700000,
        [200000, 700000],
        1980,
        2619,
        [0, 167000],
        [0, 167000],
        0,
        [5, 16],
        16,
    ]
    assert got["errors"] == [
        "NVMLError_NotSupported",
        "NVMLError_InvalidArgument",
        "NVMLError_InvalidArgument",
        "NVMLError_InvalidArgument",
    ]
