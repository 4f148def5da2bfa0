"""cgpud's /metrics against the ground truth: a real cgpud in core_mem mode
on the simulated GPU with `cgpuctl run` tenants (two computing under the
fixed policy, one holding memory only), scraped over real HTTP and parsed
with prometheus-client's own parser; compared with `cgpuctl list`, with
what the tenants allocated and with the simulator's per-process device
time (`cgpu-sim-stat --sample`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.native import native_path
from tests.harness.sim import write_sim_config
from tests.harness.daemon import BIN, Daemon, make_daemon
from tests.harness.promscrape import scrape, value
from tests.harness.net import free_port as _free_port
from tests.harness.sharerun import Sampler, ShareRig, _at, _busy, start_burn_tenant

MIB = 1 << 20
SECOND = 1_000_000_000


class Tenants:
    """`cgpuctl run` tenants on a ShareRig's cgpud, each one cgpu-burn."""

    def __init__(self, rig: ShareRig) -> None:
        self.rig = rig
        self.runs: list[subprocess.Popen[bytes]] = []

    def start(self, mem: str, core: int, *burn: str) -> int:
        run = start_burn_tenant(self.rig.daemon, mem, core, *burn)
        self.runs.append(run)
        return self.rig._burn_pid(run, time.monotonic() + 60)

    def stop(self) -> None:
        for r in self.runs:
            if r.poll() is None:
                r.send_signal(signal.SIGTERM)
        for r in self.runs:
            try:
                r.wait(timeout=30)
            except subprocess.TimeoutExpired:
                r.kill()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[ShareRig, int]]:
    port = _free_port()
    r = ShareRig(tmp_path, dict(os.environ), "--metrics-listen", f"127.0.0.1:{port}")
    yield r, port
    r.close()


def _instances(d: Daemon) -> list[dict[str, object]]:
    out = d.cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_scrape_matches_cgpuctl_list_and_the_simulator(rig: tuple[ShareRig, int]) -> None:
    r, port = rig
    d = r.daemon
    assert d.cgpuctl("policy", "set", "fixed").returncode == 0
    tenants = Tenants(r)
    sampler = Sampler(r.env, 50)
    try:
        burn = ("--duration", "600", "--kernel-ns", "200000", "--streams", "4")
        pids = {
            "a": tenants.start("2GiB", 30, "--alloc", "512MiB", *burn),
            "b": tenants.start("1GiB", 20, "--alloc", "256MiB", *burn),
            "m": tenants.start("3GiB", 0, "--alloc", "768MiB", "--hold", "600"),
        }
        r._wait_running(sampler, [pids["a"], pids["b"]], time.monotonic() + 60)
        time.sleep(2.5)  # two of the engine's 1 s windows with every tenant at its share
        before = scrape(port)
        t1 = sampler.samples[-1]
        t0 = _at(sampler.samples, t1[0] - SECOND)
        listed = _instances(d)
        assert d.cgpuctl("release", "no-such-instance").returncode != 0
        after = scrape(port)
    finally:
        tenants.stop()
        sampler.stop()

    # Every instance cgpuctl lists, with its grant as the limit.
    by_pid = {}
    for inst in listed:
        assert isinstance(inst, dict)
        grant = inst["grants"][0]  # type: ignore[index]
        labels = {"instance_id": str(inst["id"]), "gpu": str(grant["gpu"]), "UUID": str(grant["uuid"])}
        assert value(before, "cgpu_instance_memory_limit_bytes", **labels) == grant["memory_bytes"]
        assert value(before, "cgpu_instance_compute_share_percent", **labels) == grant["core_percent"]
        by_pid[int(inst["pids"][0])] = labels  # type: ignore[index]
    assert len(listed) == 3
    # cgpuctl run binds itself or the command it starts.
    labels = {name: by_pid.get(pid) or by_pid[tenants.runs[i].pid] for i, (name, pid) in enumerate(pids.items())}

    # In use: what each tenant allocated (libcgpu's accounting, tenant-reported).
    for name, allocated in (("a", 512 * MIB), ("b", 256 * MIB), ("m", 768 * MIB)):
        used = value(before, "cgpu_instance_memory_used_bytes", **labels[name])
        assert allocated <= used <= allocated + 2 * MIB, (name, used)

    # Achieved share against the simulator's own per-process device time.
    for name in ("a", "b"):
        sim = 100.0 * (_busy(t1, pids[name]) - _busy(t0, pids[name])) / (t1[0] - t0[0])
        got = value(before, "cgpu_instance_compute_achieved_percent", **labels[name])
        assert abs(got - sim) <= 5, (name, got, sim)
        assert value(before, "cgpu_instance_throttled_seconds_total", **labels[name]) > 0.5
        assert value(before, "cgpu_instance_launches_gated_total", **labels[name]) > 0
        assert value(before, "cgpu_instance_compute_grants_total", **labels[name]) > 10
        assert value(after, "cgpu_instance_compute_charged_seconds_total", **labels[name]) > value(
            before, "cgpu_instance_compute_charged_seconds_total", **labels[name]
        )
    assert value(before, "cgpu_instance_compute_achieved_percent", **labels["m"]) == 0
    assert value(before, "cgpu_instance_launches_gated_total", **labels["m"]) == 0

    # Per GPU: the sum of the grants, and NVML's busy close to the simulator's.
    gpu = {"gpu": "0"}
    assert value(before, "cgpu_gpu_memory_allocated_bytes", **gpu) == 6 * 1024 * MIB
    assert value(before, "cgpu_gpu_memory_total_bytes", **gpu) == 80 * 1024 * MIB
    assert value(before, "cgpu_gpu_instances", **gpu) == 3
    assert value(before, "cgpu_gpu_compute_allocated_percent", **gpu) == 50
    sim_busy = 100.0 * (t1[1] - t0[1]) / (t1[0] - t0[0])
    assert abs(value(before, "cgpu_gpu_utilization_percent", **gpu) - sim_busy) <= 10, sim_busy

    # Requests: cgpuctl list between the scrapes counted; the refused release an error.
    admin = {"kind": "admin"}
    assert (
        value(after, "cgpu_requests_total", method="ListInstances", **admin)
        == value(before, "cgpu_requests_total", 0, method="ListInstances", **admin) + 1
    )
    assert value(before, "cgpu_requests_total", method="CreateInstance", **admin) >= 3
    assert value(after, "cgpu_request_errors_total", method="ReleaseInstance", code="NOT_FOUND", **admin) == 1
    assert value(before, "cgpu_request_errors_total", 0, method="ReleaseInstance", code="NOT_FOUND", **admin) == 0
    assert value(before, "cgpu_reconcile_duration_seconds_count") == 1
    assert value(before, "cgpu_build_info", version=__import__("cgpud").__version__) == 1


def test_only_metrics_is_served(rig: tuple[ShareRig, int]) -> None:
    _, port = rig
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
    assert e.value.code == 404
    assert value(scrape(port), "cgpu_gpu_instances", gpu="0") == 0


def _cgpud_fails(tmp_path: Path, *extra: str) -> str:
    cfg = write_sim_config(tmp_path / "sim.conf", gpus=1)
    env = dict(
        os.environ,
        LD_LIBRARY_PATH=str(native_path("sim")),
        CGPU_SIM_CONFIG=str(cfg),
        CGPU_SIM_STATE=str(tmp_path / "sim.state"),
    )
    d = make_daemon(tmp_path, env, *extra)
    proc = subprocess.run([str(BIN / "cgpud"), *d.args], env=d.env, capture_output=True, text=True, timeout=60)
    d.notify.close()
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("cgpud: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("listen", ["9400", "localhost", "::1:9400", "[::1", "127.0.0.1:http", "127.0.0.1:70000"])
def test_a_bad_metrics_listen_stops_cgpud_with_one_clear_error(tmp_path: Path, listen: str) -> None:
    line = _cgpud_fails(tmp_path, "--metrics-listen", listen)
    assert "metrics_listen" in line and "HOST:PORT" in line, line
    assert not (tmp_path / "run" / "cgpud.sock").exists()


def test_a_metrics_port_in_use_stops_cgpud_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _cgpud_fails(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")
    assert f"cannot serve metrics on 127.0.0.1:{port}" in line and "in use" in line, line
    assert not (tmp_path / "run" / "cgpud.sock").exists()


def test_paced_instances_show_their_device_time_tenant_reported(tmp_path: Path) -> None:
    """Under `fixed` with --fixed-windows the engine hands out no grants, so
    nothing is charged; the device time the tenants' processes measure
    while they keep to their windows is the paced counter, which must
    agree with the simulator's own per-process accounting. The counter
    moves as each window ends, so over an interval it may be up to a
    window off at each end (b, 60 % of a 100 ms period: 3 points over
    4 s; it read 5.2 points off over 2 s once in CI)."""
    seconds, period_s = 4.0, 0.1
    port = _free_port()
    r = ShareRig(tmp_path, dict(os.environ), "--metrics-listen", f"127.0.0.1:{port}", "--fixed-windows")
    tenants = Tenants(r)
    sampler = Sampler(r.env, 50)
    try:
        assert r.daemon.cgpuctl("policy", "set", "fixed").returncode == 0
        burn = ("--duration", "600", "--kernel-ns", "200000", "--streams", "4")
        pids = {"a": tenants.start("1GiB", 30, *burn), "b": tenants.start("1GiB", 60, *burn)}
        r._wait_running(sampler, list(pids.values()), time.monotonic() + 60)
        time.sleep(1.0)
        before, t0 = scrape(port), sampler.samples[-1]
        time.sleep(seconds)
        after, t1 = scrape(port), sampler.samples[-1]
        listed = _instances(r.daemon)
    finally:
        tenants.stop()
        sampler.stop()
        r.close()
    by_pid = {int(i["pids"][0]): str(i["id"]) for i in listed}  # type: ignore[index]
    for name, pid in pids.items():
        iid = by_pid.get(pid) or by_pid[tenants.runs[list(pids).index(name)].pid]
        sim = 100.0 * (_busy(t1, pid) - _busy(t0, pid)) / (t1[0] - t0[0])
        paced = (
            100.0
            * (
                value(after, "cgpu_instance_compute_paced_seconds_total", instance_id=iid)
                - value(before, "cgpu_instance_compute_paced_seconds_total", instance_id=iid)
            )
            / ((t1[0] - t0[0]) / SECOND)
        )
        lag = 2 * {"a": 30, "b": 60}[name] * period_s / seconds  # points: a window at each end
        assert abs(paced - sim) <= 5 + lag, (name, paced, sim)
        assert value(after, "cgpu_instance_compute_grants_total", instance_id=iid) == 0
    assert value(after, "cgpu_gpu_compute_windowed", gpu="0") == 1
    assert value(after, "cgpu_gpu_compute_busy_windows_ended_total", gpu="0") == 0
