"""The local API end to end on a real unix socket: cgpud.api.server.serve
with a small fake service (the real daemon is tested elsewhere), the real
gRPC stack, and cgpud.cli.client.LocalClient."""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cgpud.api.cgpu.v1 import local_pb2 as pb
from cgpud.api.cgpu.v1 import local_pb2_grpc as pb_grpc
from cgpud.api.server import SERVICE_NAME, serve
from cgpud.cli.client import LocalClient
from cgpud.node import model
from cgpud.errors import AdmissionError, CgpuError, GpuQueryError, NotFoundError, StateError, UsageError

GPU = model.GpuCapacity(index=0, uuid="GPU-11111111-2222-3333-4444-555555555555", memory=16 * model.GIB)


@dataclass
class FakeService:
    """Implements cgpud.api.server.LocalService over a dict. It raises the
    same error classes the real service does, for the same kinds of reason,
    and records what it was called with."""

    regions: Path
    instances: dict[str, model.Instance] = field(default_factory=dict)
    node_policy: model.NodePolicy = field(default_factory=model.NodePolicy)
    calls: list[tuple] = field(default_factory=list)
    crash: BaseException | None = None  # raised by node_info

    def create(self, request: model.Request, pid: int | None = None) -> model.Instance:
        self.calls.append(("create", request, pid))
        if request.gpu_count < 1:
            raise UsageError(f"gpu_count must be at least 1, not {request.gpu_count}")
        if request.memory > GPU.memory:
            raise AdmissionError(f"no GPU has {request.memory >> 30} GiB free")
        iid = f"i{len(self.instances) + 1}"
        inst = model.Instance(
            id=iid,
            owner=request.owner,
            grants=(model.Grant(GPU.index, GPU.uuid, request.memory or GPU.memory, request.core_percent),),
            state=model.InstanceState.BOUND if pid is not None else model.InstanceState.RESERVED,
            enforced=True,
            weight=request.weight,
            priority=request.priority,
            pids=(pid,) if pid is not None else (),
            boot_id="boot-1",
            created=1700000000.25,
            updated=1700000000.5,
        )
        self.instances[iid] = inst
        return inst

    def bind(self, instance_id: str, pids: tuple[int, ...], owner_id: str | None = None) -> model.Instance:
        self.calls.append(("bind", instance_id, pids, owner_id))
        inst = self.get(instance_id)
        if not inst.active:
            raise StateError(f"instance {instance_id} is released; it cannot be bound")
        if owner_id is not None and owner_id != inst.owner.id:
            raise StateError(f"instance {instance_id} belongs to {inst.owner.id}, not {owner_id}")
        inst = replace(inst, state=model.InstanceState.BOUND, pids=pids)
        self.instances[instance_id] = inst
        return inst

    def release(self, instance_id: str) -> model.Instance:
        inst = replace(self.get(instance_id), state=model.InstanceState.RELEASED)
        self.instances[instance_id] = inst
        return inst

    def resize(self, instance_id: str, memory: int | None = None, core_percent: int | None = None) -> model.Instance:
        self.calls.append(("resize", instance_id, memory, core_percent))
        inst = self.get(instance_id)
        grants = tuple(
            replace(
                g,
                memory=g.memory if memory is None else memory,
                core_percent=g.core_percent if core_percent is None else core_percent,
            )
            for g in inst.grants
        )
        self.instances[instance_id] = replace(inst, grants=grants)
        return self.instances[instance_id]

    def mps_pipes(self) -> dict[int, Path]:
        return {}

    def list(self, include_released: bool = False) -> list[model.Instance]:
        return [i for i in self.instances.values() if include_released or i.active]

    def get(self, instance_id: str) -> model.Instance:
        try:
            return self.instances[instance_id]
        except KeyError:
            raise NotFoundError(f"no instance {instance_id!r}") from None

    def region_dir(self, instance_id: str) -> Path:
        return self.regions / instance_id

    def policy(self) -> model.NodePolicy:
        return self.node_policy

    def set_compute_policy(self, policy: model.ComputePolicy, gpu: int | None = None) -> model.NodePolicy:
        self.calls.append(("set_compute_policy", policy, gpu))
        if gpu is None:
            self.node_policy = replace(self.node_policy, compute_policy=policy)
        else:
            self.node_policy = replace(self.node_policy, gpu_compute_policies=((gpu, policy),))
        return self.node_policy

    def node_info(self) -> model.NodeInfo:
        if self.crash is not None:
            raise self.crash
        return model.NodeInfo(
            hostname="node-a",
            address="192.0.2.7",
            driver_version="550.54.15",
            policy=self.node_policy,
            gpus=(model.GpuUsage(gpu=GPU, allocated=4 * model.GIB, core_percent=30, instances=2),),
        )


@dataclass
class Running:
    service: FakeService
    socket: Path
    server: grpc.Server
    client: LocalClient
    channel: grpc.Channel  # for raw requests the typed client cannot make


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Running]:
    service = FakeService(regions=tmp_path / "regions")
    path = tmp_path / "run" / "cgpud.sock"
    server = serve(service, path, max_workers=4)
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        with LocalClient(path, timeout=10) as client:
            yield Running(service, path, server, client, channel)
    finally:
        channel.close()
        server.stop(None)


def _request(**kw) -> model.Request:
    return model.Request(owner=model.Owner(model.OwnerKind.CONTAINER, "c0ffee"), memory=4 * model.GIB, **kw)


# ---- the calls, round trip ------------------------------------------------------------


def test_create_round_trips_request_and_instance(api: Running) -> None:
    req = _request(gpu_count=1, core_percent=25, weight=3, priority=1)
    inst = api.client.create(req, pid=4242)
    assert api.service.calls == [("create", req, 4242)]
    assert inst == api.service.instances[inst.id]  # every field survived the wire
    assert inst.state is model.InstanceState.BOUND and inst.pids == (4242,)
    assert api.client.region_dir(inst.id) == api.service.regions / inst.id


def test_create_without_pid_or_optional_fields_takes_model_defaults(api: Running) -> None:
    stub = pb_grpc.LocalStub(api.channel)
    out = stub.CreateInstance(pb.CreateInstanceRequest(owner=pb.Owner(kind="pod", id="uid-1"), memory_bytes=1 << 30))
    ((_, req, pid),) = api.service.calls
    assert pid is None
    assert req == model.Request(owner=model.Owner(model.OwnerKind.POD, "uid-1"), memory=1 << 30)
    assert (req.gpu_count, req.weight) == (1, 1)
    assert out.state == "reserved" and out.region_dir == str(api.service.regions / out.id)


def test_explicit_zero_is_not_mistaken_for_unset(api: Running) -> None:
    with pytest.raises(UsageError, match="gpu_count must be at least 1, not 0"):
        api.client.create(_request(gpu_count=0))


def test_bind_release_list_and_get(api: Running) -> None:
    a = api.client.create(_request())
    b = api.client.create(replace(_request(), owner=model.Owner(model.OwnerKind.PROCESS, "job")))
    bound = api.client.bind(a.id, (10, 11))
    assert bound.pids == (10, 11) and bound.state is model.InstanceState.BOUND
    assert api.service.calls[-1] == ("bind", a.id, (10, 11), None)
    api.client.bind(a.id, (12,), owner_id="c0ffee")
    assert api.service.calls[-1] == ("bind", a.id, (12,), "c0ffee")

    released = api.client.release(b.id)
    assert released.state is model.InstanceState.RELEASED
    assert [i.id for i in api.client.list()] == [a.id]
    assert [i.id for i in api.client.list(include_released=True)] == [a.id, b.id]
    assert api.client.get(b.id) == api.service.instances[b.id]
    assert api.client.region_dir(b.id) is None  # its region is gone with it


def test_resize_sends_only_what_was_given(api: Running) -> None:
    """Unset stays unset on the wire: None is "as it is", 0 a real value."""
    a = api.client.create(_request())
    resized = api.client.resize(a.id, 2 * model.GIB, None)
    assert api.service.calls[-1] == ("resize", a.id, 2 * model.GIB, None)
    assert resized.grants[0].memory == 2 * model.GIB
    api.client.resize(a.id, None, 0)
    assert api.service.calls[-1] == ("resize", a.id, None, 0)
    with pytest.raises(NotFoundError, match="no instance 'nope'"):
        api.client.resize("nope", model.GIB, None)


def test_policy_and_node_info(api: Running) -> None:
    assert api.client.policy() == model.NodePolicy()
    changed = api.client.set_compute_policy(model.ComputePolicy.WEIGHTED)
    assert changed.compute_policy is model.ComputePolicy.WEIGHTED
    assert api.service.calls[-1] == ("set_compute_policy", model.ComputePolicy.WEIGHTED, None)
    one = api.client.set_compute_policy(model.ComputePolicy.NATIVE, 1)
    assert api.service.calls[-1] == ("set_compute_policy", model.ComputePolicy.NATIVE, 1)
    assert one.gpu_compute_policies == ((1, model.ComputePolicy.NATIVE),) and one.policy_for(1).name == "NATIVE"
    assert api.client.node_info() == api.service.node_info()


# ---- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("act", "error", "message"),
    [
        (lambda c: c.create(_request(gpu_count=0)), UsageError, "gpu_count must be at least 1, not 0"),
        (lambda c: c.create(replace(_request(), memory=64 * model.GIB)), AdmissionError, "no GPU has 64 GiB free"),
        (lambda c: c.get("nope"), NotFoundError, "no instance 'nope'"),
        (
            lambda c: c.bind(c.release(c.create(_request()).id).id, (1,)),
            StateError,
            "instance i1 is released; it cannot be bound",
        ),
    ],
    ids=["usage", "admission", "not-found", "state"],
)
def test_service_errors_come_back_as_the_same_class(api: Running, act, error, message) -> None:
    with pytest.raises(error) as caught:
        act(api.client)
    assert type(caught.value) is error and str(caught.value) == message


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (lambda s: s.InspectInstance(pb.InspectInstanceRequest(id="nope")), grpc.StatusCode.NOT_FOUND),
        (
            lambda s: s.CreateInstance(pb.CreateInstanceRequest(owner=pb.Owner(kind="vm", id="x"))),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (lambda s: s.CreateInstance(pb.CreateInstanceRequest(memory_bytes=1)), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda s: s.SetPolicy(pb.SetPolicyRequest(compute_policy=9)), grpc.StatusCode.INVALID_ARGUMENT),
        (
            lambda s: s.CreateInstance(
                pb.CreateInstanceRequest(owner=pb.Owner(kind="pod", id="p"), memory_bytes=1 << 40)
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            lambda s: s.BindInstance(
                pb.BindInstanceRequest(
                    id=s.ReleaseInstance(
                        pb.ReleaseInstanceRequest(
                            id=s.CreateInstance(pb.CreateInstanceRequest(owner=pb.Owner(kind="pod", id="p"))).id
                        )
                    ).id,
                    pids=[1],
                )
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (lambda s: s.BindInstance(pb.BindInstanceRequest(id="nope", pids=[1])), grpc.StatusCode.NOT_FOUND),
    ],
    ids=["not-found", "bad-owner-kind", "no-owner", "bad-compute-policy", "admission", "state", "bind-not-found"],
)
def test_status_codes_on_the_wire(api: Running, raw, code) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        raw(pb_grpc.LocalStub(api.channel))
    assert caught.value.code() == code, caught.value.details()


def test_bad_request_is_rejected_before_the_service_sees_it(api: Running) -> None:
    stub = pb_grpc.LocalStub(api.channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.SetPolicy(pb.SetPolicyRequest(compute_policy=9))
    assert "compute_policy: unknown value 9" in caught.value.details()
    assert api.service.calls == []


def test_other_cgpu_errors_are_internal_with_their_message(api: Running) -> None:
    api.service.crash = GpuQueryError("NVML: driver not loaded")
    with pytest.raises(CgpuError) as caught:
        api.client.node_info()
    assert type(caught.value) is CgpuError and str(caught.value) == "NVML: driver not loaded"
    with pytest.raises(grpc.RpcError) as raw:
        pb_grpc.LocalStub(api.channel).GetNodeInfo(pb.GetNodeInfoRequest())
    assert raw.value.code() == grpc.StatusCode.INTERNAL


def test_a_bug_in_the_service_is_internal_and_one_line(api: Running) -> None:
    api.service.crash = KeyError("gpu 7")
    with pytest.raises(CgpuError) as caught:
        api.client.node_info()
    assert type(caught.value) is CgpuError
    assert "internal error in cgpud (KeyError" in str(caught.value) and "\n" not in str(caught.value)
    # The server still serves.
    assert api.client.policy() == model.NodePolicy()


def test_out_of_range_argument_is_a_usage_error_in_the_client(api: Running) -> None:
    with pytest.raises(UsageError, match="invalid request"):
        api.client.create(_request(), pid=1 << 40)
    assert api.service.calls == []


# ---- health, socket, reachability ----------------------------------------------------------


def test_health_reports_serving(api: Running) -> None:
    stub = health_pb2_grpc.HealthStub(api.channel)
    for name in ("", SERVICE_NAME):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
    assert SERVICE_NAME == "cgpu.v1.Local"
    with pytest.raises(grpc.RpcError) as caught:
        stub.Check(health_pb2.HealthCheckRequest(service="cgpu.v1.Nope"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_socket_is_0600_in_a_0700_directory(api: Running) -> None:
    st = api.socket.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(api.socket.parent.stat().st_mode) == 0o700


def _stale_socket(path: Path) -> None:
    """What a kill -9'd server leaves: a socket file nobody listens on."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    assert stat.S_ISSOCK(path.lstat().st_mode)


def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "run" / "cgpud.sock"
    _stale_socket(path)
    service = FakeService(regions=tmp_path)
    server = serve(service, path)
    try:
        # A stale socket refuses connections: answering proves it was replaced.
        with LocalClient(path, timeout=10) as client:
            assert client.policy() == model.NodePolicy()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        server.stop(None)


def test_a_live_server_is_not_stolen_from(tmp_path: Path) -> None:
    path = tmp_path / "run" / "cgpud.sock"
    path.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        inode = path.lstat().st_ino
        with pytest.raises(CgpuError, match="another process already serves on"):
            serve(FakeService(regions=tmp_path), path)
        assert path.lstat().st_ino == inode


def test_refuses_a_non_socket_in_the_way(tmp_path: Path) -> None:
    path = tmp_path / "run" / "cgpud.sock"
    path.parent.mkdir(mode=0o700)
    path.write_text("precious")
    with pytest.raises(CgpuError, match="not a socket"):
        serve(FakeService(regions=tmp_path), path)
    assert path.read_text() == "precious"


def test_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(CgpuError, match="writable by other users"):
        serve(FakeService(regions=tmp_path), shared / "cgpud.sock")
    assert not (shared / "cgpud.sock").exists()


def test_client_says_when_cgpud_is_not_running(tmp_path: Path) -> None:
    missing = tmp_path / "run" / "cgpud.sock"
    with LocalClient(missing, timeout=5) as client, pytest.raises(CgpuError) as caught:
        client.list()
    assert str(caught.value) == f"cannot reach cgpud at {missing}: is it running? (systemctl status cgpud)"

    _stale_socket(missing)  # file present, nobody listening: refused
    with LocalClient(missing, timeout=5) as client, pytest.raises(CgpuError) as caught:
        client.list()
    assert "is it running? (systemctl status cgpud)" in str(caught.value)


def test_a_client_gets_through_soon_after_cgpud_starts(tmp_path: Path) -> None:
    # A long-lived client (not just a one-shot cgpuctl) that first met no
    # daemon must not stay in gRPC's reconnect backoff (1 s and growing, by
    # default) once the daemon is up.
    path = tmp_path / "run" / "cgpud.sock"
    with LocalClient(path, timeout=5) as client:
        with pytest.raises(CgpuError, match="is it running"):
            client.list()
        server = serve(FakeService(regions=tmp_path), path)
        try:
            started = time.monotonic()
            while True:
                try:
                    assert client.list() == []
                    break
                except CgpuError:
                    assert time.monotonic() - started < 0.7, "client still backing off"
                    time.sleep(0.02)
        finally:
            server.stop(None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user and back")
def test_client_says_the_socket_is_root_only(tmp_path: Path) -> None:
    # The real situation: a non-root user runs cgpuctl against root's socket.
    # The interpreter lives under /root, so a subprocess as `nobody` could not
    # even start: switch this process's effective uid instead (glibc applies
    # it to every thread, gRPC's included) and switch back.
    path = tmp_path / "run" / "cgpud.sock"
    server = serve(FakeService(regions=tmp_path), path)
    try:
        # Fresh channels that never connected as root (gRPC could otherwise
        # reuse an established connection from its global subchannel pool).
        with LocalClient(path, timeout=5) as refused, LocalClient(path, timeout=5) as root:
            os.seteuid(65534)
            try:
                with pytest.raises(CgpuError) as caught:
                    refused.list()
            finally:
                os.seteuid(0)
            assert str(caught.value) == f"cannot reach cgpud at {path}: its socket is root-only; run as root"
            # Root gets through at once: the other client's failed connection
            # is not shared with this one.
            assert root.list() == []
    finally:
        server.stop(None)
