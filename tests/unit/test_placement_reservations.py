"""Reservations in placement: what a cluster scheduler's Reserve may hold
(check_reservation, each rule and message), how reservations count in
gpu_usage and admit, what an instance takes off its pod's reservation
(consume), and over random sequences of reserves and admits that nothing is
ever granted twice (hypothesis)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.node.model import GIB, MIB, GpuCapacity, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner
from cgpud.node.model import OwnerKind, Request, Reservation, Share
from cgpud.node.placement import admit, check_reservation, consume, gpu_usage
from cgpud.errors import AdmissionError, StateError, UsageError

OWNER = Owner(OwnerKind.POD, "uid-a/main")
CGPU = NodePolicy(mode=NodeMode.CGPU)
CORE_MEM = NodePolicy(mode=NodeMode.CORE_MEM)


def node(*gib: float) -> tuple[GpuCapacity, ...]:
    return tuple(GpuCapacity(i, f"GPU-{i:08x}", int(g * GIB)) for i, g in enumerate(gib))


TWO = node(16, 16)


def held(
    gpus: tuple[GpuCapacity, ...],
    *parts: tuple[int, float, int],
    name: str = "held",
    state: InstanceState = InstanceState.BOUND,
) -> Instance:
    grants = tuple(Grant(i, gpus[i].uuid, int(g * GIB), core) for i, g, core in parts)
    return Instance(id=name, owner=Owner(OwnerKind.CONTAINER, name), grants=grants, state=state, enforced=True)


def share(gpu: int, gib: float, core: int = 0, instances: int = 1) -> Share:
    return Share(gpu, int(gib * GIB), core, instances)


def reservation(uid: str, *shares: Share) -> Reservation:
    return Reservation(uid, "ns", f"pod-{uid}", tuple(shares), expires=1000.0)


def req(gib: float, **kw: Any) -> Request:
    return Request(owner=OWNER, memory=int(gib * GIB), **kw)


# --------------------------------------------------------------------------
# gpu_usage


def test_gpu_usage_counts_reservations_on_top_of_instances():
    active = [held(TWO, (0, 2, 0))]
    usage = gpu_usage(
        TWO, active, [reservation("a", share(0, 3, 10, 2), share(1, 4, 0, 1)), reservation("b", share(1, 1, 5, 0))]
    )
    got = [(u.gpu.index, u.allocated // GIB, u.core_percent, u.instances) for u in usage]
    assert got == [(0, 5, 10, 3), (1, 5, 5, 1)]


def test_gpu_usage_without_reservations_is_as_before():
    active = [held(TWO, (0, 2, 0), (1, 3, 0))]
    assert gpu_usage(TWO, active) == gpu_usage(TWO, active, [])


def test_gpu_usage_skips_shares_on_gpus_the_node_does_not_have():
    usage = gpu_usage(TWO, [], [reservation("a", share(7, 3))])
    assert [(u.allocated, u.instances) for u in usage] == [(0, 0), (0, 0)]


# --------------------------------------------------------------------------
# admit


def test_a_reservation_makes_its_gpu_full_for_other_requests():
    reserved = [reservation("uid-a", share(0, 14))]
    with pytest.raises(AdmissionError, match="the scheduler chose GPU 0: no GPU has 4 GiB free: most free is 2 GiB"):
        admit(req(4, gpu_indexes=(0,)), TWO, [], CGPU, reserved)
    # Placement chooses around it when nobody named the GPU.
    [grant] = admit(req(4), TWO, [], CGPU, reserved)
    assert grant.gpu_index == 1


def test_the_reserving_pod_draws_on_its_own_reservation():
    reserved = [reservation("uid-a", share(0, 14))]
    [grant] = admit(req(14, gpu_indexes=(0,), reservation="uid-a"), TWO, [], CGPU, reserved)
    assert (grant.gpu_index, grant.memory) == (0, 14 * GIB)


def test_only_its_own_reservation_is_left_out():
    reserved = [reservation("uid-a", share(0, 8)), reservation("uid-b", share(0, 8))]
    with pytest.raises(AdmissionError, match="most free is 8 GiB on GPU 0"):
        admit(req(9, gpu_indexes=(0,), reservation="uid-a"), TWO, [], CGPU, reserved)
    [grant] = admit(req(8, gpu_indexes=(0,), reservation="uid-a"), TWO, [], CGPU, reserved)
    assert grant.memory == 8 * GIB


def test_a_request_naming_no_reservation_never_draws_on_one():
    # "" must not match a reservation stored under an empty pod UID.
    reserved = [reservation("", share(0, 16)), reservation("uid-b", share(1, 16))]
    with pytest.raises(AdmissionError):
        admit(req(1), TWO, [], CGPU, reserved)


def test_reserved_instance_slots_count_against_the_instance_limit():
    policy = NodePolicy(mode=NodeMode.CGPU, max_instances_per_gpu=2)
    one = node(16)
    reserved = [reservation("uid-b", share(0, 1, 0, 2))]
    with pytest.raises(AdmissionError, match="GPU 0 already holds 2 instances"):
        admit(req(1), one, [], policy, reserved)
    assert admit(req(1, reservation="uid-b"), one, [], policy, reserved)


def test_reserved_compute_counts_against_the_compute_left():
    one = node(16)
    reserved = [reservation("uid-b", share(0, 1, 60))]
    with pytest.raises(AdmissionError, match="no GPU has 50% compute left: most left is 40% on GPU 0"):
        admit(req(1, core_percent=50), one, [], CORE_MEM, reserved)


def test_whole_gpu_modes_see_a_reserved_gpu_as_in_use():
    one = node(16)
    with pytest.raises(AdmissionError, match="GPU 0 is in use"):
        admit(req(0), one, [], NodePolicy(mode=NodeMode.DEFAULT), [reservation("uid-b", share(0, 1))])


# --------------------------------------------------------------------------
# check_reservation: wrong requests


@pytest.mark.parametrize(
    "shares, policy, message",
    [
        pytest.param([], CGPU, "a reservation needs at least one GPU share", id="no-shares"),
        pytest.param([share(0, 1), share(0, 2)], CGPU, "the reservation names GPU 0 more than once", id="gpu-twice"),
        pytest.param(
            [share(1, 1), share(1, 1), share(0, 1), share(0, 1)],
            CGPU,
            "the reservation names GPUs 0 and 1 more than once",
            id="gpus-twice",
        ),
        pytest.param(
            [share(2, 1)],
            CGPU,
            r"the reservation names GPU 2, which this node does not have \(it has GPUs 0 and 1\): "
            "the scheduler's view of this node is out of date",
            id="absent-gpu",
        ),
        pytest.param(
            [share(0, 1), share(5, 1), share(3, 1)],
            CGPU,
            "the reservation names GPUs 3 and 5, which this node does not have",
            id="absent-gpus",
        ),
        pytest.param(
            [Share(0, 0)],
            CGPU,
            "the reservation asks for 0 bytes on GPU 0: ask for a memory size above 0",
            id="zero-memory",
        ),
        pytest.param([Share(1, -5)], CGPU, "asks for -5 bytes on GPU 1", id="negative-memory"),
        pytest.param(
            [share(0, 17)],
            CGPU,
            r"the reservation asks for 17 GiB on GPU 0, which has 16 GiB: ask for 16 GiB or less "
            r"\(aliyun.com/gpu-mem\)",
            id="more-than-the-gpu",
        ),
        pytest.param(
            [share(0, 1, 0, -1)], CGPU, "asks for -1 instance slots on GPU 0: use 0 or more", id="negative-instances"
        ),
        pytest.param(
            [share(0, 1, 10)],
            CGPU,
            "node mode cgpu does not enforce compute shares; reserve without a core percentage",
            id="core-on-cgpu",
        ),
        pytest.param(
            [share(0, 1, 10)],
            NodePolicy(mode=NodeMode.SHARE),
            "node mode share does not enforce compute",
            id="core-on-share",
        ),
        pytest.param(
            [share(0, 1, 7)],
            CORE_MEM,
            r"asks for 7% compute on GPU 0: ask for 0 \(no share\) or a multiple of 5 from 5 to 100",
            id="core-off-step",
        ),
        pytest.param([share(0, 1, 105)], CORE_MEM, "asks for 105% compute on GPU 0", id="core-over-100"),
        pytest.param([share(0, 1, -5)], CORE_MEM, "asks for -5% compute on GPU 0", id="core-negative"),
        pytest.param(
            [share(0, 1, 10)],
            NodePolicy(mode=NodeMode.CORE_MEM, core_step=25),
            "a multiple of 25 from 25 to 100",
            id="core-step-25",
        ),
        pytest.param([share(0, 1)], NodePolicy(mode="warp"), "unknown node mode 'warp'", id="bad-mode"),
    ],
)
def test_wrong_reservations_are_usage_errors(shares, policy, message):
    with pytest.raises(UsageError, match=message):
        check_reservation(shares, TWO, [], [], policy)


def test_a_node_without_gpus_says_so():
    with pytest.raises(UsageError, match=r"which this node does not have \(it has no GPUs\)"):
        check_reservation([share(0, 1)], (), [], [], CGPU)


@pytest.mark.parametrize("mode", [NodeMode.DEFAULT, NodeMode.TOPOLOGY], ids=lambda m: m.value)
def test_whole_gpu_nodes_refuse_reservations(mode):
    with pytest.raises(
        StateError,
        match=f"node mode {mode.value} gives whole GPUs \\(nvidia.com/gpu\\); "
        "cgpu-scheduler reserves only on nodes that share GPUs",
    ):
        check_reservation([share(0, 1)], TWO, [], [], NodePolicy(mode=mode))


@pytest.mark.parametrize(
    "mode", [NodeMode.CGPU, NodeMode.SHARE, NodeMode.MPS, NodeMode.CORE_MEM], ids=lambda m: m.value
)
def test_sharing_nodes_take_a_memory_reservation(mode):
    assert check_reservation([share(0, 16), share(1, 1, 0, 0)], TWO, [], [], NodePolicy(mode=mode)) is None


def test_core_mem_takes_a_compute_share():
    assert check_reservation([share(0, 1, 100), share(1, 1, 5)], TWO, [], [], CORE_MEM) is None


# --------------------------------------------------------------------------
# check_reservation: does not fit now


@pytest.mark.parametrize(
    "shares, active, others, policy, message",
    [
        pytest.param(
            [share(0, 5)],
            [held(TWO, (0, 12, 0))],
            [],
            CGPU,
            r"GPU 0 has 4 GiB free \(of 16 GiB\) and the reservation asks for 5 GiB; "
            "release an instance or reserve less",
            id="memory-instances",
        ),
        pytest.param(
            [share(1, 5)],
            [],
            [reservation("b", share(1, 12))],
            CGPU,
            r"GPU 1 has 4 GiB free \(of 16 GiB\) and the reservation asks for 5 GiB",
            id="memory-reserved",
        ),
        pytest.param(
            [share(0, 1), share(1, 5)],
            [held(TWO, (1, 6, 0))],
            [reservation("b", share(1, 6))],
            CGPU,
            r"GPU 1 has 4 GiB free \(of 16 GiB\)",
            id="memory-both",
        ),
        pytest.param(
            [Share(0, 512 * MIB)],
            [held(TWO, (0, 15.75, 0))],
            [],
            CGPU,
            "GPU 0 has 256 MiB free .* asks for 512 MiB",
            id="memory-mib",
        ),
        pytest.param(
            [share(0, 1, 0, 2)],
            [held(TWO, (0, 1, 0), name="x")],
            [],
            NodePolicy(mode=NodeMode.CGPU, max_instances_per_gpu=2),
            r"GPU 0 has room for 1 instance more \(max_instances_per_gpu=2, 1 held\) and the reservation "
            "asks for 2; release one or raise the limit",
            id="room",
        ),
        pytest.param(
            [share(0, 1, 0, 1)],
            [],
            [reservation("b", share(0, 1, 0, 3))],
            NodePolicy(mode=NodeMode.CGPU, max_instances_per_gpu=2),
            r"GPU 0 has room for 0 instances more \(max_instances_per_gpu=2, 3 held\)",
            id="room-over",
        ),
        pytest.param(
            [share(0, 1, 50)],
            [held(TWO, (0, 1, 30))],
            [reservation("b", share(0, 1, 30))],
            CORE_MEM,
            "GPU 0 has 40% compute left and the reservation asks for 50%; release an instance or reserve "
            "a smaller core percentage",
            id="compute",
        ),
    ],
)
def test_reservations_that_do_not_fit_now(shares, active, others, policy, message):
    with pytest.raises(AdmissionError, match=message):
        check_reservation(shares, TWO, active, others, policy)


def test_zero_instance_slots_fit_on_a_gpu_at_its_limit():
    policy = NodePolicy(mode=NodeMode.CGPU, max_instances_per_gpu=1)
    assert check_reservation([share(0, 1, 0, 0)], TWO, [held(TWO, (0, 1, 0))], [], policy) is None


def test_released_instances_hold_nothing_for_a_reservation():
    gone = held(TWO, (0, 16, 0), state=InstanceState.RELEASED)
    assert check_reservation([share(0, 16)], TWO, [gone], [], CGPU) is None


def test_the_last_byte_fits_exactly():
    assert check_reservation([share(0, 4)], TWO, [held(TWO, (0, 6, 0))], [reservation("b", share(0, 6))], CGPU) is None


def test_a_wrong_request_is_reported_before_a_full_node():
    # Whatever the node holds, a size no GPU has is the request's fault.
    with pytest.raises(UsageError):
        check_reservation([share(0, 17)], TWO, [held(TWO, (0, 16, 0))], [], CGPU)


# --------------------------------------------------------------------------
# consume


def test_consume_takes_the_grant_off_its_gpus_share():
    r = reservation("a", share(0, 8, 40, 2), share(1, 4, 20, 1))
    left = consume(r, [Grant(0, "GPU-0", 3 * GIB, 10)])
    assert left == (share(0, 5, 30, 1), share(1, 4, 20, 1))


def test_consume_drops_a_share_left_with_no_memory():
    r = reservation("a", share(0, 4), share(1, 4))
    assert consume(r, [Grant(0, "GPU-0", 4 * GIB, 0)]) == (share(1, 4),)
    assert consume(r, [Grant(0, "GPU-0", 4 * GIB, 0), Grant(1, "GPU-1", 4 * GIB, 0)]) == ()


def test_consume_never_goes_below_zero():
    r = reservation("a", share(0, 4, 10, 0))
    assert consume(r, [Grant(0, "GPU-0", 2 * GIB, 30)]) == (share(0, 2, 0, 0),)
    assert consume(r, [Grant(0, "GPU-0", 6 * GIB, 0)]) == ()


def test_consume_ignores_grants_on_other_gpus():
    r = reservation("a", share(1, 4))
    assert consume(r, [Grant(0, "GPU-0", 2 * GIB, 0)]) == (share(1, 4),)


# --------------------------------------------------------------------------
# Properties: reserves and admits together never grant anything twice


@st.composite
def steps(draw):
    """A node, its policy and a sequence of: reserve for one of a few pods,
    admit a request (drawing on a pod's reservation or none), unreserve."""
    gpus = draw(st.lists(st.integers(1, 32), min_size=1, max_size=4).map(lambda s: node(*s)))
    mode = draw(st.sampled_from([NodeMode.CGPU, NodeMode.CORE_MEM, NodeMode.SHARE]))
    policy = NodePolicy(mode=mode, max_instances_per_gpu=draw(st.integers(1, 4)))
    pods = ["p0", "p1", "p2"]
    out = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["reserve", "admit", "admit", "unreserve"]))
        pod = draw(st.sampled_from(pods))
        core = draw(st.sampled_from([0, 25, 50])) if mode == NodeMode.CORE_MEM else 0
        memory = draw(st.integers(1, 16)) * GIB
        if kind == "reserve":
            picked = draw(
                st.lists(st.sampled_from([g.index for g in gpus]), min_size=1, max_size=len(gpus), unique=True)
            )
            out.append(("reserve", pod, [Share(i, memory, core, draw(st.integers(0, 2))) for i in picked]))
        elif kind == "admit":
            uid = draw(st.sampled_from([*pods, ""]))
            out.append(("admit", uid, Request(OWNER, memory, 1, core, reservation=uid)))
        else:
            out.append(("unreserve", pod, None))
    return gpus, policy, out


@settings(max_examples=200, deadline=None)
@given(steps())
def test_reservations_and_instances_never_overcommit_a_gpu(scenario):
    gpus, policy, plan = scenario
    active: list[Instance] = []
    reserved: dict[str, Reservation] = {}
    for n, (kind, pod, arg) in enumerate(plan):
        if kind == "reserve":
            others = [r for uid, r in reserved.items() if uid != pod]
            try:
                check_reservation(arg, gpus, active, others, policy)
            except (AdmissionError, UsageError):
                continue
            reserved[pod] = Reservation(pod, "ns", pod, tuple(arg), 1000.0)
        elif kind == "admit":
            try:
                grants = admit(arg, gpus, active, policy, list(reserved.values()))
            except (AdmissionError, UsageError):
                continue
            active.append(Instance(f"i{n}", OWNER, grants, InstanceState.BOUND, True))
            own = reserved.get(pod) if pod else None
            if own is not None:
                left = consume(own, grants)
                if left:
                    reserved[pod] = Reservation(pod, "ns", pod, left, 1000.0)
                else:
                    del reserved[pod]
        else:
            reserved.pop(pod, None)
        for u in gpu_usage(gpus, active, list(reserved.values())):
            assert u.allocated <= u.gpu.memory
            assert u.core_percent <= 100
            assert u.instances <= policy.max_instances_per_gpu
