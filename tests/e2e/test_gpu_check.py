"""`python -m bench.gpu_check` (docs/gpu-check.md) on the simulated GPU: the
command the lent H200 runs, every check included, kept alive here. The
simulated machine is only the environment it starts in (the loader pointed
at the simulated driver); the command's table is printed into the test
run's output. Then the checks shown able to fail, and the modes they change
put back as they were found."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import cudakit
from cgpud._region import lib
from tests.harness.sim import region_mounts, sim_env_in

ROOT = Path(__file__).resolve().parents[2]
# An H100 80GB: the shape the simulator models MIG for (docs/simulated-gpu.md).
CONTAINER_ENV = "CGPU_SIM_CONFIG CGPU_SIM_STATE"
EVERY_CHECK = {
    "setup.build",
    "memory.driver",
    "memory.cudart",
    "memory.vmm",
    "memory.nvml",
    "compute.fixed.1ms",
    "compute.fixed.10ms",
    "compute.fixed.graph",
    "compute.fair.1ms",
    "compute.native.1ms",
    "compute.fixed-windows.1ms",
    "compute.fixed-windows.10ms",
    "compute.busy-windows.1ms",
    "handover.fair.streams",
    "handover.fair.query",
    "handover.fair.none",
    "handover.preemptive.ctx",
    "handover.weighted.events",
    "away.fixed",
    "overhead.launch",
    "overhead.allocfree",
    "overhead.meminfo",
    "overhead.vmm",
    "overhead.kernel-loop",
    "watchdog.memory",
    "watchdog.unknown",
    "watchdog.compute",
    "container.shim",
    "container.cdi",
    "modes.mps",
    "modes.mig",
    "hami.memory",
    "hami.share",
    "hami.overhead",
    "safety.state",
    "safety.mounts",
}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """The run's TMPDIR: short, as cgpud's sockets must fit in sun_path
    (pytest's tmp_path may not), and checked empty after the run."""
    path = Path(tempfile.mkdtemp(prefix="gc-", dir="/tmp"))
    yield path
    left = region_mounts(path)  # cgpud keeps instance tmpfs across restarts: the checks detach them
    for point in left:
        lib.cgpu_region_unmount(point.encode())
    shutil.rmtree(path, ignore_errors=True)
    assert left == [], left


def machine_env(tmp_path: Path, native: Path, gpus: int = 1, **config: object) -> dict[str, str]:
    env = sim_env_in(tmp_path / "gpu", native, gpus=gpus, mem="80GiB", **config)
    env["CGPU_CHECK_CONTAINER_ENV"] = CONTAINER_ENV
    return env


def gpu_check(env: dict[str, str], out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--quick",
            "--json",
            str(out),
            "--cuda-cache",
            str(cudakit.cache_root()),
            *args,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def show(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """Onto the test run's output even without -s (CI runs without it)."""
    with capsys.disabled():
        print("\n" + text)


@pytest.mark.timing
@pytest.mark.slow
def test_every_check_runs_and_passes_on_the_simulated_gpu(tmp_path, native, capsys, short_tmp):
    cudakit.toolkit()  # installed before the clock starts, as ./dev test does
    env = dict(machine_env(tmp_path, native), TMPDIR=str(short_tmp))
    out = tmp_path / "gpu-check.json"
    t0 = time.monotonic()
    done = gpu_check(env, out)
    took = time.monotonic() - t0
    show(capsys, done.stdout + f"(gpu-check --quick on the simulated GPU: {took:.1f} s wall)")
    report = json.loads(out.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert set(statuses) == EVERY_CHECK, set(statuses) ^ EVERY_CHECK
    not_passed = {n: s for n, s in statuses.items() if s != "PASS"}
    # the only skip the simulated machine has: no HAMi library was given
    assert not_passed == {"hami.memory": "SKIP", "hami.share": "SKIP", "hami.overhead": "SKIP"}, "\n".join(
        f"{c['name']} {c['status']}: {c['detail']}" for c in report["checks"] if c["status"] != "PASS"
    )
    assert all(c["detail"] == "HAMi: no --hami path given" for c in report["checks"] if c["name"].startswith("hami."))
    assert done.returncode == 0 and report["passed"] is True, done.stderr[-2000:]
    # 50 s here before the hand-over and cgpud-away checks, which add about 30
    assert took <= 120, f"gpu-check --quick took {took:.1f} s (CI keeps it within 120)"
    # the JSON's documented fields
    assert {"machine", "checks", "quick", "started", "seconds", "version", "passed"} <= set(report)
    assert report["machine"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    for c in report["checks"]:
        assert set(c) == {"name", "group", "status", "figure", "expected", "detail", "seconds", "values"}
    fixed = next(c for c in report["checks"] if c["name"] == "compute.fixed.1ms")
    assert fixed["values"]["asked"] == [30, 70] and len(fixed["values"]["shares"]) == 2
    # nothing left behind: its temporary directory is gone, no cgpud or tenant runs
    assert list(short_tmp.iterdir()) == []
    left = subprocess.run(["pgrep", "-f", str(short_tmp)], capture_output=True, text=True).stdout.split()
    assert left == [], left


def test_bad_usage_exits_2_with_one_line(tmp_path, native):
    env = machine_env(tmp_path, native)
    for args in (["--mem", "0"], ["--hami", str(tmp_path / "missing.so")], ["--no-such-flag"]):
        done = gpu_check(env, tmp_path / "x.json", *args, timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (args, done.stderr)
        assert not (tmp_path / "x.json").exists()


RIG = """
import json, sys
from dataclasses import asdict
from functools import partial
from pathlib import Path
from bench.gpu_check import build, compute, memory, modes, nvml
from bench.gpu_check.rig import Cgpud, Options, Rig
from bench.gpu_check.runner import Runner
work = Path(sys.argv[1])
rig = Rig(work, dict(__import__("os").environ), build.build(work, Path(sys.argv[2])),
          Options(quick=True, mem_gib=1, hami=None, only=frozenset()), nvml.machine())
runner = Runner(120, frozenset())
def report(extra=None):
    print(json.dumps({"results": [dict(asdict(r), status=r.status.value) for r in runner.results], **(extra or {})}))
"""


def in_machine(env: dict[str, str], work: Path, body: str) -> dict[str, Any]:
    """`body` after RIG in a process of its own on the machine of `env`
    (NVML, which the checks read in-process too, is loaded once per process
    from where the loader found it at start)."""
    done = subprocess.run(
        [sys.executable, "-c", RIG + textwrap.dedent(body), str(work), str(cudakit.cache_root())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    out["by_name"] = {r["name"]: r for r in out["results"]}
    return out


def test_a_limit_nobody_enforces_is_a_fail(tmp_path, native, short_tmp):
    """The memory check against a cgpud in share mode (env vars only, no
    libcgpu): the tenant sees and takes the whole GPU."""
    got = in_machine(
        machine_env(tmp_path, native),
        short_tmp,
        """
        d = Cgpud(work / "share", rig.env, ["--mode", "share"])
        d.start()
        try:
            runner.check("memory.driver", "memory", partial(memory.driver_api, rig, d, "alloc"))
        finally:
            d.stop()
        report()
        """,
    )["by_name"]["memory.driver"]
    assert got["status"] == "FAIL", got
    assert got["values"]["seen_total"] == 80 << 30 and got["values"]["allocated"] > 1 << 30


@pytest.mark.timing
def test_shares_nobody_enforces_are_a_fail(tmp_path, native, short_tmp):
    """The fixed-share check against a core_mem cgpud left at native: both
    tenants get half the GPU, not 30/70."""
    got = in_machine(
        machine_env(tmp_path, native),
        short_tmp,
        """
        d = Cgpud(work / "native", rig.env, ["--mode", "core_mem", "--compute-policy", "5"])
        d.start()
        try:
            shape = compute.SHAPES["1ms"]
            check = partial(compute.share_check, rig, d, "fixed", shape, compute.Alone(rig))
            runner.check("compute.fixed.1ms", "compute", check)
        finally:
            d.stop()
        report()
        """,
    )["by_name"]["compute.fixed.1ms"]
    assert got["status"] == "FAIL", got
    assert all(0.4 <= x <= 0.6 for x in got["values"]["split"]), got["values"]


def test_modes_found_changed_are_put_back(tmp_path, native, short_tmp):
    """Two GPUs found PROHIBITED (compute mode 2), the first booted in MIG
    mode with no instance: MPS (on the whole GPU) sets EXCLUSIVE_PROCESS,
    MIG makes an instance for its check (the whole GPU held meanwhile);
    afterwards both are PROHIBITED again, MIG is on, and no MIG device is left."""
    prohibited = 2
    got = in_machine(
        machine_env(tmp_path, native, gpus=2, placements=["mig=on"]),
        short_tmp,
        """
        import pynvml as n
        for i in (0, 1):
            nvml.set_compute_mode(i, 2)
        found = nvml.machine()["gpus"]
        modes.run(rig, runner)
        after = nvml.machine()["gpus"]
        with nvml.session():
            try:
                n.nvmlDeviceGetMigDeviceHandleByIndex(n.nvmlDeviceGetHandleByIndex(0), 0)
                left = True
            except n.NVMLError_NotFound:
                left = False
        report({"found": found, "after": after, "mig_device_left": left})
        """,
    )
    assert [(g["mig_mode"], g["compute_mode"]) for g in got["found"]] == [(1, prohibited), (0, prohibited)]
    mig, mps = got["by_name"]["modes.mig"], got["by_name"]["modes.mps"]
    assert mig["status"] == "PASS", mig
    assert mig["values"]["found_mode"] == mig["values"]["after_mode"] == 1
    assert mps["status"] == "PASS", mps["detail"]
    assert mps["values"]["found"] == mps["values"]["after"] == [prohibited, prohibited]
    assert mps["values"]["during"][1] == 3  # EXCLUSIVE_PROCESS on the whole GPU while cgpud ran MPS
    assert [(g["mig_mode"], g["compute_mode"]) for g in got["after"]] == [(1, prohibited), (0, prohibited)]
    assert got["mig_device_left"] is False
