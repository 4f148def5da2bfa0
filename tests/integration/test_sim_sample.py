"""cgpu-sim-stat --sample: the ground truth of per-process device time that
benchmarks read while tenants run. Real cgpu-burn processes on the simulated
GPU (fixture sim_env: a private machine of 2 GPUs); the samples are checked
against each other, against the device's busy time, and against what each
process itself launched."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from itertools import pairwise
from pathlib import Path

import pytest

MS = 1_000_000


def _sampler(native: Path, sim_env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(native / "bin" / "cgpu-sim-stat"), "--sample", *args],
        env=sim_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stat(native: Path, sim_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(native / "bin" / "cgpu-sim-stat"), *args],
        env=sim_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


def _burn(native: Path, sim_env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(native / "bin" / "cgpu-burn"), *args], env=sim_env, stdout=subprocess.PIPE, text=True)


def _device_ns(burn: subprocess.Popen[str]) -> int:
    """What the process itself launched: its device time."""
    out = burn.communicate(timeout=60)[0]
    assert burn.returncode == 0, out
    report = json.loads(out)
    assert report["errors"] == []
    return report["launches"] * report["kernel_ns"]


def _stop(sampler: subprocess.Popen[str], sig: int = signal.SIGTERM) -> list[dict]:
    sampler.send_signal(sig)
    out, err = sampler.communicate(timeout=30)
    assert sampler.returncode == 0, err
    assert out.endswith("\n")
    return [json.loads(line) for line in out.splitlines()]


# Its samples are checked against the time between them to a millisecond:
# a sampler preempted between reading the clock and the counters (four
# workers on two cores) read 3.2 ms more work than time once.
@pytest.mark.timing
def test_two_saturating_tenants(native, sim_env):
    interval = 100 * MS
    sampler = _sampler(native, sim_env, "0", "100", "0")
    first = json.loads(sampler.stdout.readline())
    burns = [_burn(native, sim_env, "--kernel-ns=200000", "--duration=1.5", "--streams=2") for _ in range(2)]
    own = {str(b.pid): _device_ns(b) for b in burns}
    time.sleep(0.3)
    samples = [first, *_stop(sampler)]

    assert first["per_pid"] == {} and first["busy_ns"] == 0
    assert set(samples[-1]["per_pid"]) == set(own)
    t0 = first["now_ns"]
    # Paced on absolute deadlines: never early, and no drift accumulates.
    for k, s in enumerate(samples):
        assert s["now_ns"] >= t0 + k * interval - MS, k
    assert samples[-1]["now_ns"] - t0 - (len(samples) - 1) * interval < interval

    for a, b in pairwise(samples):
        elapsed = b["now_ns"] - a["now_ns"]
        assert b["busy_ns"] >= a["busy_ns"]
        deltas = {pid: ns - a["per_pid"].get(pid, 0) for pid, ns in b["per_pid"].items()}
        assert all(d >= 0 for d in deltas.values()), (a, b)
        # One kernel at a time: completed work fits in the time that passed
        # (give or take a kernel being charged while a sample is read).
        assert sum(deltas.values()) <= elapsed + MS, (a, b)
        assert abs(sum(deltas.values()) - (b["busy_ns"] - a["busy_ns"])) <= max(elapsed // 100, MS), (a, b)
    for s in samples:
        assert all(ns <= s["now_ns"] - t0 for ns in s["per_pid"].values()), s

    last = samples[-1]
    assert abs(sum(last["per_pid"].values()) - (last["busy_ns"] - first["busy_ns"])) <= last["busy_ns"] // 100
    # Each process's total is its own device time.
    for pid, ns in own.items():
        assert abs(last["per_pid"][pid] - ns) <= ns // 100, (pid, last["per_pid"][pid], ns)

    # The steady middle: the device is full and each gets about half.
    middle = [s for s in samples if t0 + 400 * MS <= s["now_ns"] <= t0 + 1300 * MS]
    a, b = middle[0], middle[-1]
    span = b["now_ns"] - a["now_ns"]
    assert (b["busy_ns"] - a["busy_ns"]) / span >= 0.97
    for pid in own:
        share = (b["per_pid"][pid] - a["per_pid"][pid]) / (b["busy_ns"] - a["busy_ns"])
        assert 0.40 <= share <= 0.60, (pid, share)


def test_process_gone_before_its_slot_was_seen_again(native, sim_env):
    # A runs and exits, then B takes A's process slot, all between two
    # samples: A's time comes from the execution records.
    sampler = _sampler(native, sim_env, "0", "3000", "2")
    first = json.loads(sampler.stdout.readline())
    a = _burn(native, sim_env, "--kernel-ns=100000", "--duration=0.3")
    a_ns = _device_ns(a)
    b = _burn(native, sim_env, "--kernel-ns=100000", "--duration=0.3")
    b_ns = _device_ns(b)
    out, err = sampler.communicate(timeout=30)
    assert sampler.returncode == 0, err
    last = json.loads(out.splitlines()[-1])
    assert last["now_ns"] > first["now_ns"]
    assert last["per_pid"] == {str(a.pid): a_ns, str(b.pid): b_ns}
    assert last["busy_ns"] == a_ns + b_ns


def test_process_followed_then_replaced(native, sim_env):
    # A is seen running, exits, and B claims its slot: A keeps its full total.
    sampler = _sampler(native, sim_env, "0", "50", "0")
    a = _burn(native, sim_env, "--kernel-ns=100000", "--duration=0.6")
    while json.loads(sampler.stdout.readline())["per_pid"].get(str(a.pid), 0) == 0:
        pass
    a_ns = _device_ns(a)
    b = _burn(native, sim_env, "--kernel-ns=100000", "--duration=0.3")
    b_ns = _device_ns(b)
    time.sleep(0.2)
    samples = _stop(sampler, signal.SIGINT)
    assert samples[-1]["per_pid"] == {str(a.pid): a_ns, str(b.pid): b_ns}
    for x, y in pairwise(samples):
        assert all(ns >= x["per_pid"].get(pid, 0) for pid, ns in y["per_pid"].items())


def test_count_lines_on_an_idle_gpu(native, sim_env):
    out = _stat(native, sim_env, "--sample", "1", "20", "5")
    assert out.returncode == 0, out.stderr
    samples = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(samples) == 5
    assert all(s["per_pid"] == {} and s["busy_ns"] == 0 for s in samples)
    # Deadlines are absolute (start + k x 20 ms) and a sample's stamp is taken
    # when it wakes, so one late wake-up shortens the next gap: two stamps are
    # not 20 ms apart, but the samples never come in a burst.
    assert all(y["now_ns"] > x["now_ns"] for x, y in pairwise(samples))
    assert samples[-1]["now_ns"] - samples[0]["now_ns"] >= 3 * 20 * MS


@pytest.mark.parametrize(
    "args",
    [
        ["--sample"],
        ["--sample", "0", "100"],
        ["--sample", "x", "100", "1"],
        ["--sample", "0", "0", "1"],
        ["--sample", "0", "100", "-1"],
        ["--sample", "0", "1.5", "1"],
        ["--sample", "0", "100", "1", "extra"],
        ["--sample", "2", "100", "1"],
    ],
    ids=["no-args", "missing-count", "bad-gpu", "zero-interval", "negative-count", "fraction", "extra", "no-such-gpu"],
)
def test_bad_arguments(native, sim_env, args):
    proc = _stat(native, sim_env, *args)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
