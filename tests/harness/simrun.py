"""Running test programs against the simulated GPUs in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

# Subprocess programs import cudapy and usage_tenant by bare name from here.
TESTS_DIR = Path(__file__).resolve().parent


def py_env(sim_env: dict[str, str]) -> dict[str, str]:
    env = dict(sim_env)
    env["PYTHONPATH"] = str(TESTS_DIR) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_py(sim_env: dict[str, str], code: str, timeout: float = 60) -> Any:
    """Run a script that prints one JSON value; return it."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=py_env(sim_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"script failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_py(sim_env: dict[str, str], code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=py_env(sim_env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def sim_stat(native: Path, sim_env: dict[str, str], *args: str) -> Any:
    proc = subprocess.run(
        [str(native / "bin" / "cgpu-sim-stat"), *args], env=sim_env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# Prelude of the pynvml scripts run on the simulated GPUs: `err(f)` gives the
# NVMLError class name a call raises, or "ok"; `addr(h)` a handle's address;
# `xid_set(*gpus)` a new event set registered for those GPUs' XIDs;
# `drain(s)` the data of every event the set holds now, oldest first.
PYNVML = """
import ctypes as C, json, subprocess, sys, time, pynvml as n
def err(f):
    try:
        f()
        return "ok"
    except n.NVMLError as e:
        return type(e).__name__
def addr(h):
    return C.cast(h, C.c_void_p).value
def xid_set(*gpus):
    s = n.nvmlEventSetCreate()
    for i in gpus:
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(i), n.nvmlEventTypeXidCriticalError, s)
    return s
def drain(s):
    got = []
    while True:
        try:
            got.append(n.nvmlEventSetWait_v2(s, 0).eventData)
        except n.NVMLError_Timeout:
            return got
"""
