"""The Capacity API without a server: the NodeView of a snapshot (pure),
the ReserveRequest checks, listen addresses and the advertised address,
and the servicer over a real InstanceService (real SQLite) in-process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from cgpud.api.capacity import CapacityServicer, NodeFacts, NodeSnapshot, node_facts, node_view, nvlink_pairs
from cgpud.api.capacity import reserve_from_pb
from cgpud.api.capacity_server import CapacityTls, advertised, serve_capacity
from cgpud.api.cgpu.v1 import capacity_pb2 as pb
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as pb_grpc
from cgpud.api.listen import Endpoint, is_loopback, parse_endpoint, plaintext_problem, tls_problem
from cgpud.node.inventory import Gpu, Inventory
from cgpud.node.model import GIB, GpuCapacity, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner, OwnerKind
from cgpud.node.model import Placement, Reservation, Share
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.errors import CgpuError, UsageError
from cgpud.extender.model import node_from_pb
from cgpud.node.topology import SINGLE, SYSTEM, Link

GPUS = (GpuCapacity(0, "GPU-a", 16 * GIB), GpuCapacity(1, "GPU-b", 16 * GIB))
FACTS = NodeFacts(
    "node-1", ("10.0.0.7",), "580.65.06", "NVIDIA-A10", 16 * GIB, 2, {0: "NVIDIA A10", 1: "NVIDIA A10"}, ((0, 1),)
)


def _instance(
    iid: str,
    kind: OwnerKind,
    owner: str,
    grants: list[tuple[int, int, int]],
    state: InstanceState = InstanceState.BOUND,
) -> Instance:
    return Instance(
        iid, Owner(kind, owner), tuple(Grant(i, f"GPU-{i}", m * GIB, c) for i, m, c in grants), state, enforced=True
    )


def _snapshot(**kw: object) -> NodeSnapshot:
    base: dict[str, object] = dict(
        facts=FACTS,
        incarnation="inc",
        revision=7,
        policy=NodePolicy(),
        gpus=GPUS,
        active=(),
        reservations=(),
        health={},
    )
    base.update(kw)
    return NodeSnapshot(**base)  # type: ignore[arg-type]


# ---- the view -----------------------------------------------------------------------


def test_an_empty_node_shows_its_facts_policy_and_every_gpu_free():
    view = node_view(_snapshot(policy=NodePolicy(NodeMode.CORE_MEM, Placement.SPREAD, 8, 10)))
    assert (view.incarnation, view.revision, view.node_name, list(view.addresses)) == ("inc", 7, "node-1", ["10.0.0.7"])
    assert (view.mode, view.placement, view.core_step, view.driver_version) == ("core_mem", "spread", 10, "580.65.06")
    assert (view.card.name, view.card.memory_bytes, view.card.count) == ("NVIDIA-A10", 16 * GIB, 2)
    assert [
        (
            g.index,
            g.uuid,
            g.model,
            g.memory_total_bytes,
            g.memory_allocated_bytes,
            g.instances,
            g.max_instances,
            g.healthy,
        )
        for g in view.gpus
    ] == [(0, "GPU-a", "NVIDIA A10", 16 * GIB, 0, 0, 8, True), (1, "GPU-b", "NVIDIA A10", 16 * GIB, 0, 0, 8, True)]
    assert [(n.gpu_a, n.gpu_b) for n in view.nvlinks] == [(0, 1)]
    assert not view.reservations and not view.pod_instances and view.other_instances == 0


def test_instances_and_reservations_count_together_and_the_reserved_part_alone():
    pod = _instance("i1", OwnerKind.POD, "uid-1/default/train/main", [(0, 4, 20)])
    host = _instance("i2", OwnerKind.PROCESS, "bench", [(1, 2, 0)], InstanceState.RESERVED)
    gone = _instance("i3", OwnerKind.PROCESS, "old", [(0, 8, 0)], InstanceState.RELEASED)
    held = Reservation("uid-2", "default", "infer", (Share(0, 3 * GIB, 10, 2), Share(1, 5 * GIB)), 1000.5)
    view = node_view(_snapshot(active=(pod, host, gone), reservations=(held,)))
    g0, g1 = view.gpus
    assert (g0.memory_allocated_bytes, g0.core_allocated_percent, g0.instances) == (7 * GIB, 30, 3)
    assert (g0.memory_reserved_bytes, g0.core_reserved_percent) == (3 * GIB, 10)
    assert (g1.memory_allocated_bytes, g1.instances, g1.memory_reserved_bytes) == (7 * GIB, 2, 5 * GIB)
    [r] = view.reservations
    assert (r.pod_uid, r.pod_namespace, r.pod_name, r.expires_unix_ms) == ("uid-2", "default", "infer", 1000500)
    assert [(s.gpu_index, s.memory_bytes, s.core_percent, s.instances) for s in r.shares] == [
        (0, 3 * GIB, 10, 2),
        (1, 5 * GIB, 0, 1),
    ]
    [p] = view.pod_instances
    assert (p.instance_id, p.pod_uid, p.pod_namespace, p.pod_name, p.container) == (
        "i1",
        "uid-1",
        "default",
        "train",
        "main",
    )
    assert [(s.gpu_index, s.memory_bytes, s.core_percent) for s in p.shares] == [(0, 4 * GIB, 20)]
    assert view.other_instances == 1  # the host process; the released one is gone


def test_a_pod_owner_the_device_plugin_did_not_write_is_shown_by_its_whole_id():
    odd = _instance("i9", OwnerKind.POD, "just-a-uid", [(1, 1, 0)])
    [p] = node_view(_snapshot(active=(odd,))).pod_instances
    assert (p.pod_uid, p.pod_namespace, p.pod_name, p.container) == ("just-a-uid", "", "", "")


def test_health_comes_from_the_provider_and_a_gpu_it_does_not_name_is_healthy():
    view = node_view(_snapshot(health={1: (False, "XID 79 (GPU has fallen off the bus)")}))
    assert [(g.healthy, g.health_reason) for g in view.gpus] == [
        (True, ""),
        (False, "XID 79 (GPU has fallen off the bus)"),
    ]
    unexplained = node_view(_snapshot(health={0: (False, "")}))
    assert (unexplained.gpus[0].healthy, unexplained.gpus[0].health_reason) == (False, "unhealthy")


def test_the_extender_reads_the_view_back_as_the_same_numbers():
    pod = _instance("i1", OwnerKind.POD, "uid-1/ns/p/c", [(1, 6, 0)])
    held = Reservation("uid-2", "ns", "q", (Share(0, 2 * GIB),), 50.0)
    state = node_from_pb(node_view(_snapshot(active=(pod,), reservations=(held,))))
    assert [(g.index, g.memory_free) for g in state.gpus] == [(0, 14 * GIB), (1, 10 * GIB)]
    assert {(p.pod_uid, p.reserved) for p in state.pods} == {("uid-1", False), ("uid-2", True)}


def test_a_stream_read_with_kept_shares_gives_the_states_read_whole():
    from cgpud.extender.model import KeptShares

    kept = KeptShares()
    pod = _instance("i1", OwnerKind.POD, "uid-1/ns/p/c", [(1, 6, 0)])
    a = Reservation("uid-2", "ns", "q", (Share(0, 2 * GIB),), 50.0)
    b = Reservation("uid-3", "ns", "r", (Share(1, 1 * GIB),), 50.0)
    views = [
        node_view(_snapshot(active=(pod,), reservations=(a,))),
        node_view(_snapshot(active=(pod,), reservations=(a, b))),
        node_view(_snapshot(reservations=(b, Reservation("uid-2", "ns", "q", (Share(1, 3 * GIB),), 50.0)))),
        node_view(_snapshot(active=(pod,))),
    ]
    states = [node_from_pb(v, kept) for v in views]
    assert states == [node_from_pb(v) for v in views]
    # The same entry again is the PodShare made the first time.
    assert states[1].pods[0] is states[0].pods[0] and states[1].pods[1] is states[0].pods[1]
    assert states[2].pods[1] is states[1].pods[2]  # uid-3, now first of the reservations
    assert states[2].pods[0].gpus != states[1].pods[1].gpus  # uid-2 changed: made again


@dataclass(frozen=True)
class _G:
    index: int
    pci_bus_id: str
    nvlink_peers: tuple[str, ...]


def test_nvlink_peers_become_index_pairs_once_each():
    gpus = [
        _G(0, "00000000:17:00.0", ("0000:65:00.0", "00000000:CA:00.0")),
        _G(1, "00000000:65:00.0", ("00000000:17:00.0",)),
        _G(2, "00000000:CA:00.0", ("00000000:17:00.0", "00000000:ff:00.0")),  # ff: an NVSwitch, not a GPU
        _G(3, "00000000:E3:00.0", ()),
    ]
    assert nvlink_pairs(gpus) == ((0, 1), (0, 2))


def test_node_facts_from_the_inventory():
    inv = Inventory(
        "580.1",
        12080,
        (
            Gpu(0, "GPU-a", "NVIDIA A10", 24 * GIB, 72, "00000000:17:00.0", 0, (8, 6), ("00000000:65:00.0",)),
            Gpu(1, "GPU-b", "NVIDIA A10", 24 * GIB, 72, "00000000:65:00.0", 1, (8, 6), ("00000000:17:00.0",)),
        ),
    )
    facts = node_facts(inv, "n", ["10.0.0.1", "", "10.0.0.1", "127.0.0.1"])
    assert facts.addresses == ("10.0.0.1", "127.0.0.1")
    assert (facts.card_name, facts.card_memory, facts.card_count, facts.nvlinks) == (
        "NVIDIA-A10",
        24 * GIB,
        2,
        ((0, 1),),
    )
    assert facts.models == {0: "NVIDIA A10", 1: "NVIDIA A10"}
    assert facts.links == {(0, 1): Link(SYSTEM, 1)}  # no PCIe levels read: the farthest
    empty = node_facts(Inventory("580.1", 12080, ()), "n", [])
    assert (empty.card_name, empty.card_count, empty.nvlinks) == ("", 0, ())


# ---- requests -------------------------------------------------------------------------


def _reserve(**kw: object) -> pb.ReserveRequest:
    base: dict[str, object] = dict(
        pod_uid="u1",
        pod_namespace="default",
        pod_name="p",
        shares=[pb.Share(gpu_index=1, memory_bytes=GIB), pb.Share(gpu_index=0, memory_bytes=2 * GIB, instances=2)],
    )
    base.update(kw)
    return pb.ReserveRequest(**base)  # type: ignore[arg-type]


def test_a_reserve_request_decodes_sorted_with_zero_instances_as_one_and_ttl_zero_as_the_default():
    args = reserve_from_pb(_reserve())
    assert args.shares == (Share(0, 2 * GIB, 0, 2), Share(1, GIB, 0, 1))
    assert (args.pod_uid, args.namespace, args.name, args.ttl) == ("u1", "default", "p", None)
    assert reserve_from_pb(_reserve(ttl_seconds=30)).ttl == 30.0


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(pod_uid=""), "needs the pod's UID"),
        (dict(pod_uid="  "), "needs the pod's UID"),
        (dict(pod_uid="a/b"), "holds a '/'"),
        (dict(pod_name="x/y"), "holds a '/'"),
        (dict(ttl_seconds=3601), "at most 3600"),
        (dict(shares=[]), "names no GPU share"),
        (
            dict(shares=[pb.Share(gpu_index=1, memory_bytes=GIB), pb.Share(gpu_index=1, memory_bytes=GIB)]),
            "names GPU 1 twice",
        ),
    ],
)
def test_a_wrong_reserve_request_is_a_usage_error(kw, message):
    with pytest.raises(UsageError, match=message):
        reserve_from_pb(_reserve(**kw))


# ---- addresses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, host, port",
    [
        ("127.0.0.1:9455", "127.0.0.1", 9455),
        ("0.0.0.0:0", "0.0.0.0", 0),
        ("[::1]:80", "::1", 80),
        ("[::]:9455", "::", 9455),
        ("node-1.example:9455", "node-1.example", 9455),
        (" localhost:1 ", "localhost", 1),
    ],
)
def test_listen_addresses_parse(text, host, port):
    assert parse_endpoint(text, "capacity_listen") == Endpoint(host, port)


@pytest.mark.parametrize(
    "text",
    [
        "9455",
        "127.0.0.1",
        "::1:9455",
        "[::1]",
        "[::1]9455",
        "[nope]:1",
        ":9455",
        "127.0.0.1:65536",
        "127.0.0.1:-1",
        "127.0.0.1:x",
        "a b:1",
    ],
)
def test_wrong_listen_addresses_name_the_setting(text):
    with pytest.raises(UsageError, match="capacity_listen"):
        parse_endpoint(text, "capacity_listen")


def test_loopback_is_127_8_and_v6_one_and_localhost_only():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "node-1", "128.0.0.1"))


def test_plaintext_only_on_loopback_unless_insecure_or_tls():
    assert plaintext_problem(Endpoint("127.0.0.1", 1), tls=False, insecure=False) is None
    assert plaintext_problem(Endpoint("0.0.0.0", 1), tls=True, insecure=False) is None
    assert plaintext_problem(Endpoint("0.0.0.0", 1), tls=False, insecure=True) is None
    problem = plaintext_problem(Endpoint("0.0.0.0", 9455), tls=False, insecure=False)
    assert problem and "capacity_tls_cert" in problem and "capacity_insecure" in problem
    assert tls_problem("", "", "") is None and tls_problem("a", "b", "c") is None
    assert tls_problem("a", "", "c") == (
        "TLS for the Capacity API needs capacity_tls_cert, capacity_tls_key and "
        "capacity_tls_ca together; capacity_tls_key is not set"
    )
    with pytest.raises(UsageError, match="capacity_tls_cert, capacity_tls_key are not set"):
        CapacityTls.from_settings("", "", "ca.pem")
    assert CapacityTls.from_settings("", "", "") is None


def test_tls_files_that_are_missing_or_not_pem_are_named(tmp_path: Path):
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "k.pem").write_text("garbage")
    with pytest.raises(UsageError, match="capacity_tls_key: .*k.pem is not a PEM file"):
        CapacityTls(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "c.pem").credentials()
    with pytest.raises(UsageError, match="capacity_tls_ca: cannot read .*missing.pem"):
        CapacityTls(tmp_path / "c.pem", tmp_path / "c.pem", tmp_path / "missing.pem").credentials()


def test_the_advertised_address():
    bound = Endpoint("0.0.0.0", 9455)
    assert str(advertised(bound, "", "192.0.2.2")) == "192.0.2.2:9455"
    assert str(advertised(Endpoint("::", 9455), "", "192.0.2.2")) == "192.0.2.2:9455"
    assert str(advertised(Endpoint("10.1.1.1", 9455), "", "192.0.2.2")) == "10.1.1.1:9455"
    assert str(advertised(bound, "cgpu.node-1:443", "192.0.2.2")) == "cgpu.node-1:443"
    assert str(advertised(bound, "fd00::7", "")) == "[fd00::7]:9455"  # no port: the bound one
    assert str(advertised(bound, "[fd00::7]", "")) == "[fd00::7]:9455"
    with pytest.raises(UsageError, match="capacity_advertise"):
        advertised(bound, "", "")


# ---- the servicer over a real service -------------------------------------------------------


class _Context:
    """The parts of grpc.ServicerContext the servicer uses."""

    def __init__(self) -> None:
        self.active = True
        self.code: grpc.StatusCode | None = None

    def is_active(self) -> bool:
        return self.active

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise RuntimeError(details)


@pytest.fixture
def service(tmp_path: Path):
    store = Store(tmp_path / "cgpud.db")
    try:
        yield InstanceService(store, GPUS, NodePolicy(), tmp_path / "regions", "580", "boot")
    finally:
        store.close()


def test_watch_gives_the_full_view_then_one_per_change_and_ends_when_the_client_leaves(service):
    servicer = CapacityServicer(service, FACTS, watch_poll=0.05)
    ctx = _Context()
    stream = servicer.WatchNode(pb.WatchNodeRequest(), ctx)
    first = next(stream)
    assert first.revision == service.changes.revision and not first.reservations
    got: list[pb.NodeView] = []
    reader = threading.Thread(target=lambda: got.extend([next(stream)]))
    reader.start()
    servicer.Reserve(_reserve(), _Context())
    reader.join(5)
    assert [len(v.reservations) for v in got] == [1] and got[0].revision > first.revision
    assert got[0].gpus[0].memory_reserved_bytes == 2 * GIB
    # A burst: the next view holds at least the last state.
    for uid in ("u2", "u3", "u4"):
        servicer.Reserve(_reserve(pod_uid=uid), _Context())
    latest = next(stream)
    while latest.revision < service.changes.revision:
        latest = next(stream)
    assert {r.pod_uid for r in latest.reservations} == {"u1", "u2", "u3", "u4"}
    ctx.active = False
    t0 = time.monotonic()
    assert list(stream) == []  # ends within one poll
    assert time.monotonic() - t0 < 1.0


def test_watch_paces_views_a_burst_comes_as_one_and_a_change_after_quiet_at_once(service):
    servicer = CapacityServicer(service, FACTS, watch_poll=0.05, watch_pace=0.3)
    stream = servicer.WatchNode(pb.WatchNodeRequest(), _Context())
    next(stream)
    shown = time.monotonic()
    for uid in ("u1", "u2", "u3", "u4", "u5"):
        servicer.Reserve(_reserve(pod_uid=uid, shares=[pb.Share(gpu_index=0, memory_bytes=GIB)]), _Context())
    burst = next(stream)
    assert time.monotonic() - shown >= 0.25  # not before the pace since the last view
    assert {r.pod_uid for r in burst.reservations} == {"u1", "u2", "u3", "u4", "u5"}
    assert burst.revision == service.changes.revision
    time.sleep(0.35)
    changed = time.monotonic()
    servicer.Reserve(_reserve(pod_uid="u6", shares=[pb.Share(gpu_index=0, memory_bytes=GIB)]), _Context())
    after_quiet = next(stream)
    assert time.monotonic() - changed < 0.2 and "u6" in {r.pod_uid for r in after_quiet.reservations}


def test_stop_ends_every_watch(service):
    servicer = CapacityServicer(service, FACTS, watch_poll=0.05)
    stream = servicer.WatchNode(pb.WatchNodeRequest(), _Context())
    next(stream)
    servicer.stop()
    assert list(stream) == []


def test_errors_map_to_status_codes_with_the_service_message_and_change_nothing(service):
    servicer = CapacityServicer(service, FACTS)
    before = service.changes.revision
    for request, code in (
        (_reserve(shares=[pb.Share(gpu_index=0, memory_bytes=17 * GIB)]), grpc.StatusCode.INVALID_ARGUMENT),
        (_reserve(ttl_seconds=4000), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        ctx = _Context()
        with pytest.raises(RuntimeError):
            servicer.Reserve(request, ctx)
        assert ctx.code == code
    servicer.Reserve(_reserve(pod_uid="a", shares=[pb.Share(gpu_index=0, memory_bytes=10 * GIB)]), _Context())
    ctx = _Context()
    with pytest.raises(RuntimeError, match="GPU 0 has 6 GiB free"):
        servicer.Reserve(_reserve(pod_uid="b", shares=[pb.Share(gpu_index=0, memory_bytes=7 * GIB)]), ctx)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [r.pod_uid for r in service.reservations()] == ["a"] and service.changes.revision == before + 1
    service.set_node_policy(NodeMode.DEFAULT, Placement.BINPACK)
    ctx = _Context()
    with pytest.raises(RuntimeError, match="whole GPUs"):
        servicer.Reserve(_reserve(pod_uid="c"), ctx)
    assert ctx.code == grpc.StatusCode.FAILED_PRECONDITION
    ctx = _Context()
    with pytest.raises(RuntimeError, match="needs the pod's UID"):
        servicer.Unreserve(pb.UnreserveRequest(pod_uid=""), ctx)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT


def test_reserve_and_unreserve_answer_with_the_revision_that_counts_them(service):
    servicer = CapacityServicer(service, FACTS)
    held = servicer.Reserve(_reserve(ttl_seconds=60), _Context())
    assert held.revision == service.changes.revision and held.incarnation == service.changes.incarnation
    assert abs(held.expires_unix_ms / 1000 - (time.time() + 60)) < 5
    assert servicer.GetNode(pb.GetNodeRequest(), _Context()).revision >= held.revision
    gone = servicer.Unreserve(pb.UnreserveRequest(pod_uid="u1"), _Context())
    assert gone.released and gone.revision == held.revision + 1
    again = servicer.Unreserve(pb.UnreserveRequest(pod_uid="u1"), _Context())
    assert not again.released and again.revision == gone.revision


def test_serving_refuses_plaintext_off_loopback_and_a_port_already_taken(service):
    with pytest.raises(UsageError, match="capacity_listen = '0.0.0.0:0' is not a loopback address"):
        serve_capacity(CapacityServicer(service, FACTS), "0.0.0.0:0", None, False)
    first = serve_capacity(CapacityServicer(service, FACTS), "127.0.0.1:0", None, False)
    try:
        assert first.port > 0 and first.address == f"127.0.0.1:{first.port}" and not first.tls
        with pytest.raises(CgpuError, match=f"cannot listen on 127.0.0.1:{first.port} .*the port is in use"):
            serve_capacity(CapacityServicer(service, FACTS), first.address, None, False)
    finally:
        first.stop(None).wait(5)


def test_serving_on_ipv6_loopback_in_brackets(service):
    server = serve_capacity(CapacityServicer(service, FACTS), "[::1]:0", None, False)
    try:
        assert server.address == f"[::1]:{server.port}"
        with grpc.insecure_channel(server.address) as channel:
            view = pb_grpc.CapacityStub(channel).GetNode(pb.GetNodeRequest(), timeout=10)
        assert view.node_name == "node-1" and len(view.gpus) == 2
    finally:
        server.stop(None).wait(5)


def test_the_view_carries_how_each_pair_is_joined_and_the_extender_reads_it():
    facts = NodeFacts("n", (), links={(0, 1): Link(SINGLE, 2)})
    view = node_view(_snapshot(facts=facts))
    assert [(k.gpu_a, k.gpu_b, k.pcie_level, k.nvlinks) for k in view.links] == [(0, 1, SINGLE, 2)]
    assert node_from_pb(view).topology() == {(0, 1): Link(SINGLE, 2)}


def test_a_gpu_a_pod_holds_whole_is_full_and_names_the_pod():
    """cgpud keeps no instance for it: the kubelet's pod-resources says who."""
    view = node_view(_snapshot(whole={1: "ml/train/main"}))
    g0, g1 = view.gpus
    assert (g0.instances, g1.instances, g1.memory_allocated_bytes, g1.core_allocated_percent) == (0, 1, 16 * GIB, 100)
    [pod] = view.pod_instances
    assert (pod.instance_id, pod.pod_uid, pod.pod_namespace, pod.pod_name, pod.container) == (
        "",
        "",
        "ml",
        "train",
        "main",
    )
    assert [(s.gpu_index, s.memory_bytes) for s in pod.shares] == [(1, 16 * GIB)]


def test_views_built_from_kept_reservation_pieces_are_the_views_built_whole(service):
    from cgpud.api.capacity import ReservationPieces

    servicer = CapacityServicer(service, FACTS)
    pieces = ReservationPieces()
    for step, uid in enumerate(("u3", "u1", "u2", "u1", "u4")):  # u1 twice: replaced, a new row
        servicer.Reserve(_reserve(pod_uid=uid, shares=[pb.Share(gpu_index=step % 2, memory_bytes=GIB)]), _Context())
        if step == 3:
            servicer.Unreserve(pb.UnreserveRequest(pod_uid="u2"), _Context())
        snap = servicer.snapshot()
        kept = node_view(snap, pieces)
        assert kept == node_view(snap) and kept.SerializeToString() == node_view(snap).SerializeToString()
        assert [r.pod_uid for r in kept.reservations] == sorted(r.pod_uid for r in snap.reservations)
        # Only the last view's reservations are kept, each encoded once.
        assert {id(r) for r in snap.reservations} == set(pieces._kept)
    assert servicer.view() == node_view(servicer.snapshot())
