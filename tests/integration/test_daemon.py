"""cgpud as it runs on a node: a real process on a real unix socket with its
SQLite file and regions in a temp dir, driven by cgpuctl and the client,
on the simulated GPUs. Readiness is awaited on a real notify socket."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cgpud.cli.client import LocalClient
from cgpud.cli.doctor import DAEMON_ANSWER_S
from cgpud.node.model import GIB, Owner, OwnerKind, Request
from cgpud.errors import CgpuError, DaemonUnreachable
from cgpud.native import native_path
from tests.harness.daemon import BIN, make_daemon
from tests.harness.wait import until


def test_ready_only_after_reconciliation_and_stopping_on_shutdown(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env)
    d.env["WATCHDOG_USEC"] = "1000000"  # at least 4 sweeps (0.2 s): shorter is refused
    d.start()
    assert d.socket.exists() and (d.socket.stat().st_mode & 0o777) == 0o600
    assert any(b"WATCHDOG=1" in m for m in d.wait_for(b"WATCHDOG=1", timeout=5))
    d.stop()


def test_cgpuctl_run_makes_a_4gib_limit_real(daemon):
    out = daemon.cgpuctl("run", "--mem", "4GiB", "--", "cgpu-burn", "--alloc-until-fail", "1GiB")
    assert out.returncode == 0, out.stderr
    burn = json.loads(out.stdout)
    assert burn["alloc"]["until_fail_count"] == 4 and burn["mem_total_reported"] == 4 * GIB
    listed = daemon.cgpuctl("list", "--all", "--output", "json")
    [instance] = json.loads(listed.stdout)
    assert instance["state"] == "released"  # released when the process exited


def test_the_environment_names_the_instance(daemon):
    out = daemon.cgpuctl(
        "run",
        "--mem",
        "3",
        "--",
        "sh",
        "-c",
        "echo $ALIYUN_COM_GPU_MEM_CONTAINER $ALIYUN_COM_GPU_MEM_DEV $ALIYUN_COM_GPU_MEM_IDX "
        "$CUDA_VISIBLE_DEVICES; exit 7",
    )
    assert out.returncode == 7  # the command's own exit code
    assert out.stdout.split() == ["3", "16", "0", "GPU-5c1a0000-0000-4000-8000-000000c90000"]


def test_inspect_shows_the_ack_table(daemon):
    with LocalClient(daemon.socket) as client:
        for n, mem in enumerate((5, 5, 5, 4)):
            client.create(Request(Owner(OwnerKind.CONTAINER, f"c{n}"), mem * GIB))
    out = daemon.cgpuctl("inspect")
    lines = out.stdout.splitlines()
    assert re.fullmatch(
        r"NAME\s+IPADDRESS\s+GPU0\(Allocated/Total\)\s+GPU1\(Allocated/Total\)\s+GPU Memory\(GiB\)", lines[0]
    )
    assert lines[1].split()[2:] == ["15/16", "4/16", "19/32"]  # binpack fills GPU 0 first
    assert lines[2] == "-" * 78
    assert lines[3:] == ["Allocated/Total GPU Memory In Cluster:", "19/32 (59%)"]
    details = daemon.cgpuctl("inspect", "-d").stdout
    assert "Allocated :  19 (59%)" in details and "Total :      32" in details
    assert len(re.findall(r"^cgpu-\w+\s+container/c\d", details, re.MULTILINE)) == 4
    data = json.loads(daemon.cgpuctl("inspect", "--output", "json").stdout)
    assert [g["allocated_gib"] for g in data["gpus"]] == [15, 4] and len(data["instances"]) == 4


BAD = [
    (["run", "--mem", "17GiB", "--", "true"], "17 GiB"),
    (["run", "--mem", "4GiB", "--gpus", "3", "--", "true"], "3 GPUs"),
    (["run", "--mem", "4GiB", "--core", "30", "--", "true"], "does not enforce compute shares"),
    (["run", "--mem", "lots", "--", "true"], "lots"),
    (["run", "--mem", "4GiB"], "nothing to run"),
    (["policy", "set", "7"], "unknown compute policy '7'"),
    (["policy", "set", "fixed", "--gpu", "2"], "no GPU 2 on this node (it has GPUs 0 to 1)"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(b[0][:4]) for b in BAD])
def test_bad_requests_get_one_line_and_change_nothing(daemon, args, message):
    before = daemon.cgpuctl("list", "--all", "--output", "json").stdout
    out = daemon.cgpuctl(*args)
    assert out.returncode != 0
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert daemon.cgpuctl("list", "--all", "--output", "json").stdout == before


def test_a_start_that_fails_half_way_undoes_what_it_started(tmp_path, sim_env):
    """The Capacity API starts late; a port taken by another process fails
    it after the relay and the admin socket are up. cgpud says why, exits 1
    and takes both sockets down again (Daemon.start unwinds its stack)."""

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    d = make_daemon(tmp_path, sim_env, "--capacity-listen", f"127.0.0.1:{port}")
    with open(d.log, "a") as log:
        done = subprocess.run(
            [str(BIN / "cgpud"), *d.args], env=d.env, stdout=subprocess.DEVNULL, stderr=log, text=True, timeout=60
        )
    taken.close()
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in d.log.read_text()
    assert (tmp_path / "state").exists()  # it got that far
    assert not d.relay.exists() and not d.socket.exists()


def test_the_most_instances_per_gpu_is_a_clear_error(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env, "--max-instances-per-gpu", "2")
    d.start()
    try:
        with LocalClient(d.socket) as client:
            for n in range(4):  # two per GPU fit
                client.create(Request(Owner(OwnerKind.CONTAINER, f"c{n}"), GIB))
            with pytest.raises(CgpuError, match="max_instances_per_gpu"):
                client.create(Request(Owner(OwnerKind.CONTAINER, "c5"), GIB))
    finally:
        d.stop()


def test_policy_set_survives_a_restart(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env, "--mode", "core_mem")
    d.start()
    assert "compute_policy=3 (fixed)" in d.cgpuctl("policy", "set", "fixed").stdout
    assert "gpu 1: compute_policy=5 (native)" in d.cgpuctl("policy", "set", "native", "--gpu", "1").stdout
    d.kill()
    d.start()
    try:
        shown = d.cgpuctl("policy", "get").stdout
        assert "compute_policy=3 (fixed)" in shown and "gpu 1: compute_policy=5 (native)" in shown
        assert "gpu 1" not in d.cgpuctl("policy", "set", "soft").stdout  # the node's policy replaces per-GPU ones
    finally:
        d.stop()


def test_a_killed_cgpuctl_run_is_released_when_its_process_exits(daemon, tmp_path):
    flag = tmp_path / "go"
    runner = daemon.start_cgpuctl(
        "run", "--mem", "1GiB", "--", "sh", "-c", f"while [ ! -e {flag} ]; do sleep 0.05; done"
    )
    with LocalClient(daemon.socket) as client:
        deadline = time.monotonic() + 30  # for both waits together
        until(
            lambda: [i for i in client.list() if len(i.pids) == 2],
            timeout=30,
            interval=0.05,
            what="the instance bound to cgpuctl and its command",
            explain=lambda: f"instances: {client.list()}",
        )
        [instance] = client.list()
        runner.send_signal(signal.SIGKILL)  # cgpuctl dies; its command lives on
        runner.wait(timeout=30)
        time.sleep(0.5)
        assert client.get(instance.id).state.value == "bound"
        flag.touch()
        until(
            lambda: client.get(instance.id).state.value == "released",
            timeout=max(deadline - time.monotonic(), 0.0),
            interval=0.05,
            what="the instance to be released once its command exited",
            explain=lambda: f"it is {client.get(instance.id).state.value}",
        )


def test_restart_repairs_a_damaged_region(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env)
    d.start()
    with LocalClient(d.socket) as client:
        instance = client.create(Request(Owner(OwnerKind.CONTAINER, "c"), 2 * GIB))
        region = client.region_dir(instance.id)
    limits = region / "limits"
    limits.write_bytes(b"\0" * limits.stat().st_size)
    d.kill()
    d.start()
    try:
        env = dict(d.env, LD_PRELOAD=str(native_path("lib/libcgpu.so")), CGPU_REGION_DIR=str(region))
        out = subprocess.run(
            [str(native_path("bin/cgpu-burn")), "--alloc-until-fail", "1GiB"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert json.loads(out.stdout)["alloc"]["until_fail_count"] == 2, out.stderr
    finally:
        d.stop()


# host_global: doctor reads the runtime config of every containerd and dockerd running on the
# machine, and other tests run theirs.
@pytest.mark.host_global
def test_doctor_names_what_is_missing(daemon, tmp_path):
    settings = tmp_path / "doctor.toml"
    settings.write_text(f'state_dir = "{daemon.state}"\n')
    ok = daemon.cgpuctl("doctor", "--config", str(settings))
    for check in ("driver/NVML: 2 GPU(s)", "daemon socket: cgpud answers", "state directory", "libcgpu.so"):
        assert f"ok    {check}" in ok.stdout, ok.stdout
    assert "warn  container runtime" in ok.stdout and ok.returncode == 0  # nothing configured on this machine
    # A cgpud that holds the connection and says nothing (stopped) is
    # reported after DAEMON_ANSWER_S, not waited out for the call's 30 s.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        hung = daemon.cgpuctl("doctor", "--config", str(settings))
        took = time.monotonic() - started
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert hung.returncode == 1, hung.stdout
    assert f"FAIL  daemon socket: cgpud at {daemon.socket} did not answer within 5 s" in hung.stdout, hung.stdout
    assert DAEMON_ANSWER_S <= took < DAEMON_ANSWER_S + 10, took
    daemon.stop()
    down = daemon.cgpuctl("doctor", "--config", str(settings))
    assert down.returncode == 1 and "FAIL  daemon socket: cannot reach cgpud" in down.stdout


MAX_HELD = 24  # instances of 256 MiB per client: 4 x 24 x 256 MiB is 24 of the 32 GiB


def _client_loop(
    sock: Path,
    name: str,
    stop: threading.Event,
    abandon: threading.Event,
    acked: set[str],
    released: set[str],
    refused: list[str],
) -> None:
    """Creates and releases instances, retrying each call until the daemon
    (killed and restarted underneath) acknowledges it. Holds at most
    MAX_HELD, so the four clients never fill the two 16 GiB GPUs: a refusal
    from the daemon is a finding, not a reason to retry."""
    rng = random.Random(name)
    held: list[str] = []
    n = 0
    while not stop.is_set():
        n += 1
        release = held and (len(held) >= MAX_HELD or rng.random() < 0.4)
        while True:
            try:
                with LocalClient(sock, timeout=2) as client:
                    if release:
                        client.release(held[0])
                    else:
                        inst = client.create(Request(Owner(OwnerKind.CONTAINER, f"{name}-{n}"), 256 << 20))
                break
            except CgpuError as e:
                if type(e) not in (CgpuError, DaemonUnreachable):  # the daemon answered, and said no
                    refused.append(f"{name}: {'release' if release else 'create'}: {e}")
                    return
                if stop.is_set() and abandon.is_set():
                    return
                time.sleep(0.05)  # daemon down: retry the same request
        if release:
            released.add(held.pop(0))
        else:
            acked.add(inst.id)
            held.append(inst.id)


@pytest.mark.slow
def test_kill_9_at_any_instant_loses_nothing_and_grants_nothing_twice(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env, "--max-instances-per-gpu", "1000")
    d.start()
    stop, abandon = threading.Event(), threading.Event()
    acked: set[str] = set()
    released: set[str] = set()
    refused: list[str] = []
    clients = [
        threading.Thread(target=_client_loop, args=(d.socket, f"client{i}", stop, abandon, acked, released, refused))
        for i in range(4)
    ]
    for c in clients:
        c.start()
    rng = random.Random(7)
    try:
        for _ in range(8):
            time.sleep(rng.uniform(0.1, 0.6))
            d.kill()
            d.start()
    except BaseException:
        abandon.set()  # the test failed: let the clients give up
        raise
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=120)
    try:
        with LocalClient(d.socket) as client:
            active = {i.id for i in client.list()}
            info = client.node_info()
        assert not refused
        assert len(acked) > 20
        assert active == acked - released
        # Nothing double-granted: the bookkeeping equals the active grants.
        assert sum(g.allocated for g in info.gpus) == len(active) * (256 << 20)
    finally:
        d.stop()
