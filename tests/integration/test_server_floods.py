"""Hostile callers against the real servers, as processes: cgpu-scheduler's
HTTP face and cgpud's metrics and Capacity ports.

- 300 idle connections: before, each held a thread of the server for as
  long as the caller liked (300 threads). Now a new connection past the cap
  closes the longest-idle one, so /healthz (or a scrape) still answers in
  under 100 ms and the server's threads stay under its cap.
- 20 stalled 15 MiB bodies: before, each was read into one allocation
  announced by its Content-Length (300 MiB). Now bodies are read in pieces
  against one budget (64 MiB); past it a request is answered 503 unread.
- /bind without a client certificate, when the extender requires one: 403,
  no Binding; a certificate of another CA does not get through TLS.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from cgpud.api.cgpu.v1 import capacity_pb2 as pb
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as pb_grpc
from tests.harness.sim import write_sim_config
from tests.harness.daemon import make_daemon
from tests.harness.api_server import api_server, pod_json
from tests.harness.tls import Pki, make_pki
from tests.harness.net import free_port
from tests.harness.wait import until

BIN = Path(sys.executable).parent
MIB = 1 << 20
EXTENDER_CONNECTIONS = 64  # cgpud.extender.server.BOUNDS
EXTENDER_BODY_BUDGET = 64 * MIB
METRICS_CONNECTIONS = 16  # cgpud.daemon.metrics.BOUNDS


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for pid {pid}")


def threads(pid: int) -> int:
    return proc_status(pid, "Threads")


def rss(pid: int) -> int:
    return proc_status(pid, "VmRSS") * 1024


def get(port: int, path: str, context: ssl.SSLContext | None = None) -> tuple[int, float]:
    """(status, seconds) of one GET on a fresh connection."""
    t0 = time.monotonic()
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
        if context
        else http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    )
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        conn.close()


def probe_for(port: int, path: str, seconds: float, context: ssl.SSLContext | None = None) -> list[float]:
    """GET path every 50 ms for `seconds`: each one's time; each must be 200."""
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        status, took = get(port, path, context)
        assert status == 200, status
        times.append(took)
        time.sleep(0.05)
    return times


def idle_flood(port: int, n: int = 300) -> list[socket.socket]:
    """n connections that never send a byte (opened at once, kept)."""
    socks = []
    for _ in range(n):
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    return socks


def stalled_bodies(port: int, n: int = 20, size: int = 15 * MIB) -> list[socket.socket]:
    """n POSTs announcing `size` bytes, each sent but its last byte."""
    socks = []
    chunk = b"x" * MIB
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(
            f"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n".encode()
        )
        try:
            left = size - 1
            while left:
                left -= s.send(chunk[: min(len(chunk), left)])
        except OSError:  # answered 503 and closed without reading: what the budget does
            pass
        socks.append(s)
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


@contextmanager
def extender_process(tmp: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """cgpu-scheduler on 127.0.0.1, standalone, watching one node nobody serves."""
    port = free_port()
    nodes = tmp / "nodes"
    nodes.write_text(f"node-0 127.0.0.1:{free_port()}\n")
    log = tmp / "extender.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "cgpu-scheduler"), "--listen", f"127.0.0.1:{port}", "--nodes", str(nodes), *args],
            stdout=subprocess.DEVNULL,
            stderr=out,
            text=True,
        )
    try:

        def listening() -> bool:
            if "listening on" in log.read_text():
                return True
            assert proc.poll() is None, log.read_text()
            return False

        until(listening, timeout=30, interval=0.05, what="the extender to log 'listening on'", explain=log.read_text)
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_300_idle_connections_keep_the_extender_answering_within_its_thread_cap(tmp_path: Path) -> None:
    with extender_process(tmp_path) as (proc, port):
        probe_for(port, "/healthz", 1.0)  # the watcher's gRPC threads start meanwhile
        before = threads(proc.pid)
        socks = idle_flood(port)
        try:
            time.sleep(0.3)
            times = probe_for(port, "/healthz", 3.0)
            peak = threads(proc.pid)
        finally:
            close_all(socks)
        assert max(times) < 0.1, sorted(times)[-5:]
        # a thread per connection up to the cap; a few more may be the
        # process's own (gRPC's pollers of the node watcher), never 300
        assert peak - before <= EXTENDER_CONNECTIONS + 8, (before, peak)


def test_stalled_15mib_bodies_hold_no_more_than_the_budget_and_healthz_answers(tmp_path: Path) -> None:
    with extender_process(tmp_path) as (proc, port):
        get(port, "/healthz")
        before = rss(proc.pid)
        socks = stalled_bodies(port)
        try:
            time.sleep(0.5)
            times = probe_for(port, "/healthz", 2.0)
            grown = rss(proc.pid) - before
        finally:
            close_all(socks)
        assert max(times) < 0.1, sorted(times)[-5:]
        # the budget plus the interpreter's slack, not 20 x 15 MiB
        assert grown <= EXTENDER_BODY_BUDGET + 32 * MIB, grown // MIB


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def post(port: int, path: str, body: object, context: ssl.SSLContext) -> tuple[int, dict]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_bind_needs_a_client_certificate_of_the_client_ca(tmp_path: Path, pki: Pki) -> None:
    """The attack: anyone on the pod network calling /bind. With
    --client-ca only kube-scheduler's certificate gets a verb; /healthz
    stays open for the kubelet's probe."""
    with api_server(tmp_path) as (api, kubeconfig):
        api.state.add_pod(pod_json("payments-db-0", "", namespace="prod", containers={"db": {}}))
        serve = (
            "--serve-cert",
            str(pki.server_cert),
            "--serve-key",
            str(pki.server_key),
            "--client-ca",
            str(pki.ca),
            "--kubeconfig",
            str(kubeconfig),
        )
        with extender_process(tmp_path, *serve) as (_, port):
            bind = {"PodName": "payments-db-0", "PodNamespace": "prod", "PodUID": "", "Node": "control-plane-1"}
            anonymous = pki.client_context(anonymous=True)
            assert get(port, "/healthz", anonymous)[0] == 200
            status, out = post(port, "/bind", bind, anonymous)
            assert status == 403 and "needs a client certificate" in out["Error"]
            assert post(port, "/filter", {"Pod": {}, "NodeNames": []}, anonymous)[0] == 403
            assert get(port, "/inspect", anonymous)[0] == 200  # read-only, for kubectl inspect cgpu
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                post(port, "/bind", bind, pki.client_context(pki.untrusted_cert, pki.untrusted_key))
            trusted = pki.client_context()
            status, out = post(port, "/bind", bind, trusted)
            assert status == 200 and "asks for no GPU share" in out["Error"]
        assert api.state.bindings == []


@contextmanager
def cgpud_process(tmp: Path, native: Path, *args: str) -> Iterator[int]:
    env = dict(
        os.environ,
        LD_LIBRARY_PATH=str(native / "sim"),
        CGPU_SIM_CONFIG=str(write_sim_config(tmp / "sim.conf")),
        CGPU_SIM_STATE=str(tmp / "sim.state"),
    )
    d = make_daemon(tmp, env, *args)
    d.start()
    try:
        assert d.proc is not None
        yield d.proc.pid
    finally:
        d.stop()


@pytest.mark.slow
def test_300_idle_connections_and_stalled_requests_leave_cgpuds_metrics_answering(tmp_path: Path, native: Path) -> None:
    port = free_port()
    with cgpud_process(tmp_path, native, "--metrics-listen", f"127.0.0.1:{port}") as pid:
        get(port, "/metrics")
        before = threads(pid)
        socks = idle_flood(port)
        # and slow requests: a request line, then nothing
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        try:
            time.sleep(0.3)
            times = probe_for(port, "/metrics", 3.0)
            peak = threads(pid)
        finally:
            close_all(socks)
        assert max(times) < 0.1, sorted(times)[-5:]
        assert peak - before <= METRICS_CONNECTIONS, (before, peak)


def test_300_idle_connections_to_the_capacity_port_cost_cgpud_no_thread(tmp_path: Path, native: Path) -> None:
    """gRPC serves connections from its own poller, not a thread each; the
    Capacity API answers through the flood."""
    port = free_port()
    with cgpud_process(tmp_path, native, "--capacity-listen", f"127.0.0.1:{port}", "--node-name", "node-0") as pid:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.CapacityStub(channel)
            assert stub.GetNode(pb.GetNodeRequest(), timeout=5).node_name == "node-0"
            before, memory = threads(pid), rss(pid)
            socks = idle_flood(port)
            try:
                time.sleep(0.3)
                times = []
                for _ in range(20):
                    t0 = time.monotonic()
                    stub.GetNode(pb.GetNodeRequest(), timeout=5)
                    times.append(time.monotonic() - t0)
                    time.sleep(0.05)
                peak, grown = threads(pid), rss(pid) - memory
            finally:
                close_all(socks)
        assert max(times) < 0.1, sorted(times)[-5:]
        assert peak - before <= 2, (before, peak)
        assert grown < 32 * MIB, grown // MIB
