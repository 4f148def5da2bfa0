"""cgpu.v1.Capacity of a real cgpud process on the simulated GPUs (2 x 16 GiB),
over real TCP, TLS by openssl-made certificates: what a cluster scheduler
sees and what its reservations do."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgpud.api.cgpu.v1 import capacity_pb2 as pb
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as pb_grpc
from cgpud.node.model import GIB
from cgpud.kube.model import ANNOTATION_CAPACITY_ADDRESS
from tests.harness.daemon import BIN, Daemon, make_daemon, running_daemon
from tests.harness.api_server import api_server, node_json
from tests.harness.tls import Pki, make_pki
from tests.harness.net import free_port as _free_port
from tests.harness.wait import until

WAIT = 10.0


@contextmanager
def _capacity(
    tmp_path: Path, sim_env: dict[str, str], *extra: str
) -> Iterator[tuple[Daemon, pb_grpc.CapacityStub, str]]:
    address = f"127.0.0.1:{_free_port()}"
    with running_daemon(tmp_path, sim_env, "--capacity-listen", address, *extra) as d:
        with grpc.insecure_channel(address) as channel:
            yield d, pb_grpc.CapacityStub(channel), address


def _share(gpu: int, gib: int) -> pb.Share:
    return pb.Share(gpu_index=gpu, memory_bytes=gib * GIB)


def _reserve(stub: pb_grpc.CapacityStub, uid: str, *shares: pb.Share, ttl: int = 0) -> pb.Reservation:
    return stub.Reserve(
        pb.ReserveRequest(
            pod_uid=uid, pod_namespace="default", pod_name=f"pod-{uid}", shares=list(shares), ttl_seconds=ttl
        ),
        timeout=WAIT,
    )


class _Watch:
    """A WatchNode stream read by a thread into a queue."""

    def __init__(self, stub: pb_grpc.CapacityStub) -> None:
        self.stream = stub.WatchNode(pb.WatchNodeRequest())
        self.views: queue.Queue[pb.NodeView] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for view in self.stream:
                self.views.put(view)
        except grpc.RpcError:
            pass

    def next(self) -> pb.NodeView:
        return self.views.get(timeout=WAIT)

    def quiet(self, seconds: float = 0.6) -> bool:
        time.sleep(seconds)
        return self.views.empty()


def test_get_node_shows_the_simulated_gpus_and_health_serves(tmp_path, sim_env):
    with _capacity(tmp_path, sim_env) as (_, stub, address):
        view = stub.GetNode(pb.GetNodeRequest(), timeout=WAIT)
        assert [(g.index, g.memory_total_bytes, g.memory_allocated_bytes, g.healthy, g.model) for g in view.gpus] == [
            (0, 16 * GIB, 0, True, "NVIDIA H100 80GB HBM3"),
            (1, 16 * GIB, 0, True, "NVIDIA H100 80GB HBM3"),
        ]
        assert all(g.uuid.startswith("GPU-") and g.max_instances == 20 for g in view.gpus)
        assert (view.mode, view.placement, view.core_step) == ("cgpu", "binpack", 5)
        assert (view.card.name, view.card.memory_bytes, view.card.count) == ("NVIDIA-H100-80GB-HBM3", 16 * GIB, 2)
        assert view.node_name and view.driver_version and len(view.incarnation) == 32
        assert "127.0.0.1" in view.addresses
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "cgpu.v1.Capacity"):
                answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_watch_gives_the_full_view_then_one_view_per_change(tmp_path, sim_env):
    with _capacity(tmp_path, sim_env) as (d, stub, _):
        watch = _Watch(stub)
        first = watch.next()
        assert len(first.gpus) == 2 and not first.reservations and not first.pod_instances
        assert watch.quiet()

        created = d.cgpuctl("create", "--mem", "3GiB", "--name", "train-a", "--output", "json")
        assert created.returncode == 0, created.stderr
        view = watch.next()
        assert view.revision > first.revision and view.other_instances == 1
        assert sum(g.memory_allocated_bytes for g in view.gpus) == 3 * GIB
        slots_before = view.gpus[1].instances
        assert watch.quiet()

        held = _reserve(stub, "uid-1", _share(1, 5))
        view = watch.next()
        assert view.revision == held.revision and [r.pod_uid for r in view.reservations] == ["uid-1"]
        assert (view.gpus[1].memory_reserved_bytes, view.gpus[1].instances) == (5 * GIB, slots_before + 1)
        assert watch.quiet()

        assert stub.Unreserve(pb.UnreserveRequest(pod_uid="uid-1"), timeout=WAIT).released
        view = watch.next()
        assert not view.reservations and view.gpus[1].memory_reserved_bytes == 0
        assert watch.quiet()

        _reserve(stub, "uid-2", _share(0, 1), ttl=1)
        assert [r.pod_uid for r in watch.next().reservations] == ["uid-2"]
        expired = watch.next()  # the sweep (every 0.2 s here) deletes it once its second is up
        assert not expired.reservations and all(g.memory_reserved_bytes == 0 for g in expired.gpus)
        assert watch.quiet()
        watch.stream.cancel()


def test_a_reserve_for_more_than_a_gpu_holds_is_invalid_and_changes_nothing(tmp_path, sim_env):
    with _capacity(tmp_path, sim_env) as (_, stub, _address):
        before = stub.GetNode(pb.GetNodeRequest(), timeout=WAIT)
        with pytest.raises(grpc.RpcError) as err:
            _reserve(stub, "uid-big", _share(0, 17))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "17 GiB on GPU 0, which has 16 GiB" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _reserve(stub, "uid-twice", _share(0, 1), _share(0, 1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GPU 0 twice" in err.value.details()
        after = stub.GetNode(pb.GetNodeRequest(), timeout=WAIT)
        assert after.revision == before.revision and not after.reservations


def test_two_reserves_for_the_last_gib_get_it_once(tmp_path, sim_env):
    with _capacity(tmp_path, sim_env) as (_, stub, _address):
        _reserve(stub, "uid-fill", _share(0, 15))
        results: list[grpc.StatusCode] = []
        start = threading.Barrier(2)

        def race(uid: str) -> None:
            start.wait()
            try:
                _reserve(stub, uid, _share(0, 1))
                results.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                results.append(e.code())

        threads = [threading.Thread(target=race, args=(uid,)) for uid in ("uid-a", "uid-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert sorted(c.name for c in results) == ["OK", "RESOURCE_EXHAUSTED"]
        view = stub.GetNode(pb.GetNodeRequest(), timeout=WAIT)
        assert view.gpus[0].memory_allocated_bytes == 16 * GIB and len(view.reservations) == 2


def test_a_reservation_holds_memory_against_cgpuctl_create(tmp_path, sim_env):
    with _capacity(tmp_path, sim_env) as (d, stub, _address):
        _reserve(stub, "uid-1", _share(0, 10), _share(1, 10))
        refused = d.cgpuctl("create", "--mem", "8GiB", "--name", "late")
        assert refused.returncode != 0 and "free" in refused.stderr, refused.stderr
        assert json.loads(d.cgpuctl("list", "--output", "json").stdout) == []
        stub.Unreserve(pb.UnreserveRequest(pod_uid="uid-1"), timeout=WAIT)
        assert d.cgpuctl("create", "--mem", "8GiB", "--name", "late").returncode == 0


def _tls_channel(address: str, pki: Pki, cert: Path | None, key: Path | None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
    )
    return grpc.secure_channel(address, credentials)


def test_tls_serves_a_trusted_client_and_refuses_the_others_before_any_call(tmp_path, sim_env):
    pki = make_pki(tmp_path / "pki", server_ips=["127.0.0.1"])
    address = f"127.0.0.1:{_free_port()}"
    with running_daemon(
        tmp_path,
        sim_env,
        "--capacity-listen",
        address,
        "--capacity-tls-cert",
        str(pki.server_cert),
        "--capacity-tls-key",
        str(pki.server_key),
        "--capacity-tls-ca",
        str(pki.ca),
    ):
        with _tls_channel(address, pki, pki.client_cert, pki.client_key) as channel:
            trusted = pb_grpc.CapacityStub(channel)
            before = trusted.GetNode(pb.GetNodeRequest(), timeout=WAIT)
            assert len(before.gpus) == 2
            for cert, key in ((None, None), (pki.untrusted_cert, pki.untrusted_key)):
                with _tls_channel(address, pki, cert, key) as other:
                    with pytest.raises(grpc.RpcError) as err:
                        pb_grpc.CapacityStub(other).Reserve(
                            pb.ReserveRequest(pod_uid="intruder", shares=[_share(0, 16)]), timeout=WAIT
                        )
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with grpc.insecure_channel(address) as plain:  # no TLS at all
                with pytest.raises(grpc.RpcError) as err:
                    pb_grpc.CapacityStub(plain).GetNode(pb.GetNodeRequest(), timeout=WAIT)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            after = trusted.GetNode(pb.GetNodeRequest(), timeout=WAIT)
            assert after.revision == before.revision and not after.reservations
            assert _reserve(trusted, "uid-ok", _share(1, 2)).pod_uid == "uid-ok"


def test_plaintext_off_loopback_is_refused_at_start_with_what_to_set(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env, "--capacity-listen", f"0.0.0.0:{_free_port()}")
    done = subprocess.run([str(BIN / "cgpud"), *d.args], env=d.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "capacity_listen = '0.0.0.0:" in done.stderr and "is not a loopback address" in done.stderr
    assert "capacity_tls_cert" in done.stderr and "capacity_insecure = true" in done.stderr
    assert not (tmp_path / "state" / "cgpud.db").exists()  # refused before anything was set up


def test_a_live_reservation_survives_kill_9(tmp_path, sim_env):
    address = f"127.0.0.1:{_free_port()}"
    d = make_daemon(tmp_path, sim_env, "--capacity-listen", address)
    d.start()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CapacityStub(channel)
            held = _reserve(stub, "uid-1", _share(1, 6), ttl=600)
            d.kill()
            d.start()
            view = stub.GetNode(pb.GetNodeRequest(), timeout=WAIT, wait_for_ready=True)
            assert view.incarnation != held.incarnation
            [r] = view.reservations
            assert (r.pod_uid, r.expires_unix_ms, r.shares[0].memory_bytes) == ("uid-1", held.expires_unix_ms, 6 * GIB)
            assert view.gpus[1].memory_allocated_bytes == 6 * GIB
    finally:
        d.stop()


def test_kubernetes_mode_writes_the_capacity_address_on_the_node(tmp_path, sim_env):
    port = _free_port()
    with api_server(tmp_path) as (server, kubeconfig):
        server.state.nodes["node-c"] = node_json("node-c", {"ack.node.gpu.schedule": "cgpu"})
        plugins = tmp_path / "plugins"
        plugins.mkdir()
        with running_daemon(
            tmp_path,
            sim_env,
            "--orchestrator",
            "kubernetes",
            "--kubeconfig",
            str(kubeconfig),
            "--node-name",
            "node-c",
            "--device-plugin-dir",
            str(plugins),
            "--cdi-dir",
            str(tmp_path / "cdi"),
            "--pod-resources-socket",
            str(tmp_path / "none.sock"),
            "--capacity-listen",
            f"127.0.0.1:{port}",
            "--capacity-advertise",
            "198.51.100.7",
        ):

            def annotations() -> dict[str, str]:
                with server.state.lock:
                    return dict(server.state.nodes["node-c"]["metadata"].get("annotations", {}))

            notes = until(
                lambda: a if ANNOTATION_CAPACITY_ADDRESS in (a := annotations()) else None,
                timeout=WAIT,
                interval=0.1,
                what="node-c annotated with its Capacity address",
                explain=lambda: f"its annotations: {annotations()}",
            )
            assert notes.get(ANNOTATION_CAPACITY_ADDRESS) == f"198.51.100.7:{port}"
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                view = pb_grpc.CapacityStub(channel).GetNode(pb.GetNodeRequest(), timeout=WAIT)
            assert view.node_name == "node-c" and "198.51.100.7" in view.addresses


def test_a_gpu_health_change_is_a_view_change_in_standalone_mode(tmp_path, sim_env):
    with _capacity(tmp_path, sim_env, "--gpu-health-recovery-window", "0") as (_, stub, _address):
        watch = _Watch(stub)
        assert all(g.healthy for g in watch.next().gpus)
        fault = subprocess.run(
            [str(BIN / "cgpuctl"), "sim", "fault", "--gpu", "1", "--xid", "48"],
            env=sim_env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert fault.returncode == 0, fault.stderr
        view = watch.next()
        assert [(g.healthy, g.health_reason) for g in view.gpus] == [
            (True, ""),
            (False, "fatal XID 48 (double-bit ECC error)"),
        ]
        watch.stream.cancel()


def test_a_stopping_cgpud_ends_its_watch_streams_promptly(tmp_path, sim_env):
    address = f"127.0.0.1:{_free_port()}"
    d = make_daemon(tmp_path, sim_env, "--capacity-listen", address)
    d.start()
    with grpc.insecure_channel(address) as channel:
        watch = _Watch(pb_grpc.CapacityStub(channel))
        watch.next()
        t0 = time.monotonic()
        d.stop()  # SIGTERM; asserts exit status 0
        assert time.monotonic() - t0 < 5.0
        assert watch.stream.done() or watch.quiet(1.0)
        until(watch.stream.done, timeout=WAIT, interval=0.05, what="the watch stream to end")
