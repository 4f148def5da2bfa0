"""The GPU monitoring tools (nvitop, gpustat) and NVML clients run in and next
to an instance: their programs, a neighbour burning memory, and what a
client inside must see."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.harness.daemon import BIN

NVITOP = BIN / "nvitop"
GPUSTAT = BIN / "gpustat"


@contextmanager
def burner(env: dict[str, str], native: Path, mem: str, seconds: int = 60) -> Iterator[subprocess.Popen[str]]:
    """cgpu-burn holding `mem` on GPU 0 and keeping it half busy, until the block ends."""
    proc = subprocess.Popen(
        [
            str(native / "bin/cgpu-burn"),
            "--alloc",
            mem,
            "--duration",
            str(seconds),
            "--duty",
            "0.5",
            "--kernel-ns",
            "2000000",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        on_gpu(env, proc.pid)
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


# Run inside the instance: its own cgpu-burn on the GPU, then both tools.
INSIDE = """
import json, os, subprocess, sys
env = dict(os.environ, COLUMNS="160")
burn = subprocess.Popen([sys.argv[1], "--alloc", "256MiB", "--duration", "60", "--duty", "0.5",
                         "--kernel-ns", "2000000"], stdout=subprocess.DEVNULL)
try:
    subprocess.run([sys.executable, "-c", sys.argv[4], str(burn.pid)], check=True, timeout=60)
    tools = {"nvml": json.loads(subprocess.run([sys.executable, "-c", sys.argv[5]], check=True, timeout=60,
                                               capture_output=True, text=True).stdout)}
    for name, cmd in (("nvitop", [sys.argv[2], "--once"]),
                      ("gpustat", [sys.argv[3], "--no-color", "--show-cmd", "--show-pid", "--show-power", "--show-codec"])):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        tools[name] = {"rc": p.returncode, "out": p.stdout, "err": p.stderr}
    print(json.dumps({"pid": burn.pid, "tools": tools}))
finally:
    burn.kill()
    burn.wait()
"""


# Every NVML call that tells memory size or pids, straight, inside the instance.
NVML_CALLS = """
import ctypes, json, time, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
since = int(time.time() * 1e6) - 5_000_000
def pids(samples):
    return sorted(s.pid for s in samples)
def legacy_attributes():
    a = n.c_nvmlDeviceAttributes()
    assert n._nvmlGetFunctionPointer("nvmlDeviceGetAttributes")(h, ctypes.byref(a)) == 0
    return a.memorySizeMB << 20
def details(mode):
    return pids(n.nvmlDeviceGetRunningProcessDetailList(h, n.nvmlProcessDetailList_v1, mode))
def util_info_newer_version():
    # A v2 a driver might know: larger elements than the v1 array libcgpu holds.
    room = (n.c_nvmlProcessUtilizationInfo_v1_t * 4)()
    info = n.c_nvmlProcessesUtilizationInfo_v1_t(version=n.ProcessesUtilizationInfo_v1 + (1 << 24) + 8,
                                                 processSamplesCount=4, lastSeenTimeStamp=since,
                                                 procUtilArray=room)
    rc = n._nvmlGetFunctionPointer("nvmlDeviceGetProcessesUtilizationInfo")(h, ctypes.byref(info))
    return [rc, info.processSamplesCount]
def details_newer_version():
    room = (n.c_nvmlProcessDetail_v1_t * 4)()
    plist = n.c_nvmlProcessDetailList_v1_t(version=n.nvmlProcessDetailList_v1 + (1 << 24), mode=0,
                                           numProcArrayEntries=4, procArray=room)
    rc = n._nvmlGetFunctionPointer("nvmlDeviceGetRunningProcessDetailList")(h, ctypes.byref(plist))
    return [rc, plist.numProcArrayEntries, room[0].pid]
print(json.dumps({
    "total": [n.nvmlDeviceGetMemoryInfo(h).total, n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).total,
              n.nvmlDeviceGetAttributes_v2(h).memorySizeMB << 20, legacy_attributes(),
              n.nvmlDeviceGetBAR1MemoryInfo(h).bar1Total],
    "lists": [pids(f(h)) for f in (n.nvmlDeviceGetComputeRunningProcesses, n.nvmlDeviceGetComputeRunningProcesses_v2,
                                   n.nvmlDeviceGetGraphicsRunningProcesses, n.nvmlDeviceGetGraphicsRunningProcesses_v2,
                                   n.nvmlDeviceGetMPSComputeRunningProcesses, n.nvmlDeviceGetMPSComputeRunningProcesses_v2)],
    "details": [details(mode) for mode in range(4)],
    "util": pids(n.nvmlDeviceGetProcessUtilization(h, since)),
    "util_info": pids(n.nvmlDeviceGetProcessesUtilizationInfo(h, since)),
    "newer_versions": [util_info_newer_version(), details_newer_version()],
}))
"""


# Waits, inside the instance, until NVML lists the instance's burner.
WAIT_OWN = """
import sys, time, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
deadline = time.monotonic() + 30
while int(sys.argv[1]) not in [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)]:
    assert time.monotonic() < deadline, "own process never reached the GPU"
    time.sleep(0.02)
"""


def inside_argv(python: str, burn: str) -> list[str]:
    """The command that runs INSIDE under `python`, with its own cgpu-burn
    at `burn` (both paths as the instance sees them)."""
    return [python, "-c", INSIDE, burn, str(NVITOP), str(GPUSTAT), WAIT_OWN, NVML_CALLS]


def check_inside(stdout: str, neighbour: int) -> None:
    """What INSIDE saw (its last line of output): 1 GiB and its own
    process, nothing of `neighbour`."""
    got = json.loads(stdout.strip().splitlines()[-1])
    own, tools = got["pid"], got["tools"]
    calls = tools.pop("nvml")
    assert calls == {
        "total": [1 << 30] * 5,
        "lists": [[own], [own], [], [], [], []],
        "details": [[own], [], [], [own]],
        "util": [own],
        "util_info": [own],
        # ARGUMENT_VERSION_MISMATCH / INVALID_ARGUMENT (as nvml.h documents each), untouched
        "newer_versions": [[25, 4], [2, 4, 0]],
    }, (calls, own, neighbour)
    for name, t in tools.items():
        assert t["rc"] == 0, (name, t)
        assert not ERROR_TEXT.search(t["out"] + t["err"]), (name, t)
        assert str(neighbour) not in t["out"], (name, t["out"])
        assert "2048" not in t["out"], (name, t["out"])  # the neighbour's 2 GiB shows nowhere
        assert "16384" not in t["out"], (name, t["out"])  # nor the whole GPU

    top = tools["nvitop"]["out"]
    assert re.search(r"\b256(\.0)?MiB / 1024MiB", top), top
    # nvitop draws with "|" where the locale has no UTF-8 (a bare container).
    assert re.search(rf"^[│|]\s+0\s+{own}\s+C\s+\S+\s+256(\.0)?MiB", top, re.MULTILINE), top
    stat = [line for line in tools["gpustat"]["out"].splitlines() if line.startswith("[0]")]
    assert stat and re.search(r"\b256 /\s+1024 MB", stat[0]), tools["gpustat"]["out"]
    assert f"cgpu-burn/{own}(256M)" in stat[0], stat


# What either tool prints when an NVML call fails (nvitop logs the error and
# a traceback, gpustat raises) or shows "??" for a value it could not read.
ERROR_TEXT = re.compile(r"error|traceback|exception|not found", re.IGNORECASE)


def on_gpu(env: dict[str, str], pid: int, timeout: float = 30) -> None:
    """Returns once NVML lists `pid` on GPU 0 (bounded)."""
    script = textwrap.dedent(f"""
        import time, pynvml as n
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        deadline = time.monotonic() + {timeout}
        while {pid} not in [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)]:
            assert time.monotonic() < deadline, "process never reached the GPU"
            time.sleep(0.02)
    """)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=timeout + 30)
