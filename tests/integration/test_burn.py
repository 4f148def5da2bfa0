"""cgpu-burn, the workload program that uses only the CUDA driver API, run on a
private simulated machine (fixture sim_env: 2 GPUs x 16 GiB). What is checked
is what the same binary must also do on a real GPU: its arguments, each
allocation and launch API, entry-point resolution, and timing."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.harness.wait import until

GIB = 1 << 30
MIB = 1 << 20
ALLOC_APIS = ["alloc", "pitch", "managed", "async", "pool", "vmm", "array"]
LAUNCH_APIS = ["kernel", "ex", "cooperative", "graph"]


def burn(native: Path, env: dict[str, str] | None, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(native / "bin" / "cgpu-burn"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The one JSON object the program prints, alone on stdout."""
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def burn_json(native: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = burn(native, env, *args)
    assert proc.returncode == 0, proc.stderr
    out = report(proc)
    assert out["errors"] == []
    return out


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *mentions: str) -> None:
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("cgpu-burn: ")
    for word in mentions:
        assert word in lines[0]


# ---- arguments ---------------------------------------------------------------


def test_help_lists_every_option(native):
    proc = burn(native, None, "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for option in (
        "--device",
        "--alloc",
        "--alloc-api",
        "--alloc-until-fail",
        "--hold",
        "--kernel-ns",
        "--streams",
        "--duration",
        "--launches",
        "--duty",
        "--launch-api",
        "--events",
        "--per-thread-stream",
        "--resolve",
        "--require-alloc",
        "--sync-every",
        "--graph-nodes",
        "--burst-ms",
        "--gap-ms",
    ):
        assert option in proc.stdout


# arguments, and what the one error line must name
BAD_ARGS = [
    (["--bogus"], ["--bogus"]),
    (["--alloc"], ["--alloc"]),
    (["--alloc", "0"], ["--alloc", "'0'"]),
    (["--alloc", "-1GiB"], ["--alloc", "'-1GiB'"]),
    (["--alloc", "12XB"], ["--alloc", "'12XB'"]),
    (["--alloc", "99999999999999999999"], ["--alloc"]),
    (["--alloc-api", "malloc"], ["--alloc-api", "'malloc'"]),
    (["--launch-api", "stream"], ["--launch-api", "'stream'"]),
    (["--resolve", "magic"], ["--resolve", "'magic'"]),
    (["--duty", "0"], ["--duty", "'0'"]),
    (["--duty", "1.5"], ["--duty", "'1.5'"]),
    (["--streams", "0"], ["--streams", "'0'"]),
    (["--device", "-1"], ["--device", "'-1'"]),
    (["--kernel-ns", "1ms"], ["--kernel-ns", "'1ms'"]),
    (["--hold", "soon"], ["--hold", "'soon'"]),
    (["--launches", "5", "--duration", "1"], ["--launches", "--duration"]),
    (["--events=yes"], ["--events=yes"]),
    (["--burst-ms", "0", "--duration", "1"], ["--burst-ms", "'0'"]),
    (["--burst-ms", "2", "--gap-ms", "-1", "--duration", "1"], ["--gap-ms", "'-1'"]),
    (["--burst-ms", "2"], ["--burst-ms", "--duration"]),
    (["--gap-ms", "5", "--duration", "1"], ["--gap-ms", "--burst-ms"]),
    (["--burst-ms", "2", "--sync-every", "3", "--duration", "1"], ["--burst-ms", "--sync-every"]),
    (["stray"], ["'stray'"]),
]


@pytest.mark.parametrize(("args", "mentions"), BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_argument_is_one_line_and_exit_2(native, sim_env, args, mentions):
    assert_one_line_error(burn(native, sim_env, *args), *mentions)


def test_missing_driver_is_one_line_and_exit_2(native, tmp_path):
    if ctypes.util.find_library("cuda"):
        pytest.skip("a real libcuda is installed on this host")
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    assert_one_line_error(burn(native, env, "--launches", "1"), "cannot load libcuda.so.1")


# A driver that knows no entry point but cuGetProcAddress_v2 itself.
EMPTY_DRIVER = """
int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    (void)symbol; (void)version; (void)flags;
    *pfn = 0;
    *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return 500;  /* CUDA_ERROR_NOT_FOUND */
}
"""


@pytest.mark.parametrize(("resolve", "mentions"), [("proc", ["cuInit", "cuGetProcAddress"]), ("dlsym", ["cuInit"])])
def test_unresolved_function_is_named_and_exit_2(native, tmp_path, resolve, mentions):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler to build a stub driver")
    (tmp_path / "stub.c").write_text(EMPTY_DRIVER)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "stub.c")], check=True
    )
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    assert_one_line_error(burn(native, env, "--resolve", resolve), *mentions)


def test_missing_device_is_one_line_and_exit_2(native, sim_env):
    assert_one_line_error(burn(native, sim_env, "--device", "2"), "cuDeviceGet", "CUDA_ERROR_INVALID_DEVICE")


# ---- allocation ----------------------------------------------------------------


def test_report_describes_the_device(native, sim_env):
    dev0 = burn_json(native, sim_env)
    dev1 = burn_json(native, sim_env, "--device", "1")
    for dev in (dev0, dev1):
        assert dev["total_mem"] == dev["mem_total_reported"] == dev["mem_free_before"] == 16 * GIB
        assert dev["name"] == "NVIDIA H100 80GB HBM3"
        assert dev["uuid"].startswith("GPU-") and len(dev["uuid"]) == 40
    assert (dev0["device"], dev1["device"]) == (0, 1)
    assert dev0["uuid"] != dev1["uuid"]


@pytest.mark.parametrize("api", ALLOC_APIS)
def test_each_alloc_api_takes_1gib_and_memory_info_shows_it(native, sim_env, api):
    out = burn_json(native, sim_env, "--alloc", "1GiB", "--alloc-api", api)
    alloc = out["alloc"]
    assert alloc["api"] == api
    assert alloc["requested"] == [GIB]
    assert alloc["results"] == ["CUDA_SUCCESS"]
    # pitch, vmm and array round up to their shapes and granularity
    assert GIB <= alloc["granted_bytes"] <= GIB + 64 * MIB
    assert out["mem_free_before"] - out["mem_free_after_alloc"] >= GIB
    # everything was freed at exit
    assert burn_json(native, sim_env)["mem_free_before"] == 16 * GIB


@pytest.mark.parametrize("api", ALLOC_APIS)
def test_alloc_until_fail_fills_the_16_gib_gpu(native, sim_env, api):
    alloc = burn_json(native, sim_env, "--alloc-until-fail", "1GiB", "--alloc-api", api)["alloc"]
    assert alloc["until_fail_count"] == 16
    assert alloc["until_fail_bytes"] >= 16 * GIB
    assert alloc["until_fail_result"] == "CUDA_ERROR_OUT_OF_MEMORY"


def test_failed_allocation_is_a_result_unless_required(native, sim_env):
    args = ("--alloc", "1GiB", "--alloc", "17GiB")
    plain = burn(native, sim_env, *args)
    assert plain.returncode == 0, plain.stderr
    assert report(plain)["alloc"]["results"] == ["CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"]
    assert report(plain)["alloc"]["granted_bytes"] == GIB
    required = burn(native, sim_env, *args, "--require-alloc")
    assert required.returncode == 3
    assert report(required)["alloc"]["results"] == ["CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"]


def test_hold_keeps_allocations_visible_to_other_processes(native, sim_env):
    holder = subprocess.Popen(
        [str(native / "bin" / "cgpu-burn"), "--alloc", "4GiB", "--hold", "3"],
        env=sim_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until(
            lambda: burn_json(native, sim_env)["mem_free_before"] == 12 * GIB,
            timeout=10,
            interval=0.05,
            what="the held 4 GiB to show up in another process",
        )
        assert holder.poll() is None  # seen while still holding
    finally:
        out, err = holder.communicate(timeout=30)
    assert holder.returncode == 0, err
    assert json.loads(out)["alloc"]["results"] == ["CUDA_SUCCESS"]
    assert burn_json(native, sim_env)["mem_free_before"] == 16 * GIB


# ---- launches ----------------------------------------------------------------------


def spin(native: Path, sim_env: dict[str, str], *args: str) -> dict[str, Any]:
    """20 launches of 100 us: 2 ms of device time."""
    return burn_json(native, sim_env, "--launches", "20", "--kernel-ns", "100000", "--events", *args)


@pytest.mark.parametrize("api", LAUNCH_APIS)
def test_each_launch_api_runs_timed_kernels(native, sim_env, api):
    out = spin(native, sim_env, "--launch-api", api)
    assert out["launch_api"] == api
    assert out["launches"] == 20
    assert out["kernel_ns"] == 100000
    assert out["streams"] == 1
    assert out["event_ms"] == pytest.approx(2.0, abs=0.5)
    assert out["stream_event_ms"] == [out["event_ms"]]


@pytest.mark.parametrize(
    "args",
    [["--per-thread-stream"], ["--resolve", "dlsym"], ["--resolve", "dlsym", "--per-thread-stream"]],
    ids=["proc-per-thread", "dlsym", "dlsym-per-thread"],
)
def test_resolution_variants_work(native, sim_env, args):
    out = spin(native, sim_env, "--alloc", "1GiB", "--alloc-api", "async", *args)
    assert out["resolve"] == ("dlsym" if "dlsym" in args else "proc")
    assert out["per_thread_stream"] == ("--per-thread-stream" in args)
    assert out["alloc"]["results"] == ["CUDA_SUCCESS"]
    assert out["launches"] == 20
    assert out["event_ms"] == pytest.approx(2.0, abs=0.5)


def test_dlsym_per_thread_resolves_the_ptsz_symbols(native, sim_env):
    env = dict(sim_env, LD_DEBUG="symbols")
    proc = burn(native, env, "--resolve", "dlsym", "--per-thread-stream", "--launches", "1", "--kernel-ns", "1000")
    assert proc.returncode == 0
    assert "symbol=cuLaunchKernel_ptsz" in proc.stderr
    assert "symbol=cuStreamSynchronize_ptsz" in proc.stderr


def test_graph_launch_counts_every_node(native, sim_env):
    out = burn_json(
        native,
        sim_env,
        "--launch-api",
        "graph",
        "--graph-nodes",
        "3",
        "--launches",
        "7",
        "--kernel-ns",
        "100000",
        "--events",
    )
    assert out["launches"] == 9  # three launches of a three-kernel graph
    assert out["event_ms"] == pytest.approx(0.9, abs=0.3)


def test_streams_each_get_their_share(native, sim_env):
    out = spin(native, sim_env, "--streams", "2")
    assert out["streams"] == 2 and out["launches"] == 20
    # each stream ran 10 x 100 us of its own, however the device interleaves them
    assert len(out["stream_event_ms"]) == 2
    assert all(ms >= 0.9 for ms in out["stream_event_ms"])
    assert out["event_ms"] == max(out["stream_event_ms"])


@pytest.mark.parametrize(("duty", "low", "high"), [("1", 0.9, 1.5), ("0.5", 1.8, 2.8)])
def test_duty_sets_busy_share_of_wall_time(native, sim_env, duty, low, high):
    # 10 x 10 ms: long enough that launch and sleep overheads stay small
    out = burn_json(native, sim_env, "--launches", "10", "--kernel-ns", "10000000", "--duty", duty)
    assert low <= out["wall_s"] / 0.1 <= high


def test_duration_stops_the_run(native, sim_env):
    out = burn_json(native, sim_env, "--duration", "0.3", "--kernel-ns", "1000000", "--events")
    assert 0.3 <= out["wall_s"] < 0.6
    assert out["launches"] >= 100
    assert out["event_ms"] >= 250


def test_bursts_queue_the_burst_then_idle_for_the_gap(native, sim_env):
    # 2 ms of 200 us kernels over 4 streams, then 10 ms idle: about 12 ms a burst
    out = burn_json(
        native,
        sim_env,
        "--duration",
        "0.6",
        "--burst-ms",
        "2",
        "--gap-ms",
        "10",
        "--kernel-ns",
        "200000",
        "--streams",
        "4",
    )
    assert out["burst_ms"] == 2 and out["gap_ms"] == 10
    assert 30 <= out["bursts"] <= 52, out["bursts"]
    assert out["launches"] == 10 * out["bursts"]  # the last burst is whole too
    # each burst ran its 2 ms of kernels (synchronised) and idled 10 ms before the next
    assert out["wall_s"] >= (out["bursts"] - 1) * 0.012
