"""Admission and placement: each rule, each message a user reads, the shapes
ACK's documentation shows, and properties over random nodes and request
sequences (hypothesis)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.node.model import GIB, MIB, GpuCapacity, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner
from cgpud.node.model import OwnerKind, Placement, Request, Reservation, Share, WHOLE_GPU_MODES
from cgpud.node.placement import admit, admit_resize, gpu_usage
from cgpud.errors import AdmissionError, StateError, UsageError
from tests.harness.links import NVLINK_PAIRS

OWNER = Owner(OwnerKind.CONTAINER, "c0ffee")
CGPU = NodePolicy(mode=NodeMode.CGPU)
CORE_MEM = NodePolicy(mode=NodeMode.CORE_MEM)
DEFAULT = NodePolicy(mode=NodeMode.DEFAULT)
SPREAD = NodePolicy(mode=NodeMode.CGPU, placement=Placement.SPREAD)


def node(*gib: float) -> tuple[GpuCapacity, ...]:
    """GPUs 0..n-1 with these sizes in GiB."""
    return tuple(GpuCapacity(i, f"GPU-{i:08x}", int(g * GIB)) for i, g in enumerate(gib))


def held(
    gpus: tuple[GpuCapacity, ...],
    *parts: tuple[int, float, int],
    state: InstanceState = InstanceState.BOUND,
    name: str = "held",
) -> Instance:
    """An instance holding (gpu index, GiB, core percent) on each listed GPU."""
    grants = tuple(Grant(i, gpus[i].uuid, int(g * GIB), core) for i, g, core in parts)
    return Instance(id=name, owner=OWNER, grants=grants, state=state, enforced=True)


def req(gib: float, **kw: Any) -> Request:
    return Request(owner=OWNER, memory=int(gib * GIB), **kw)


def run(gpus: tuple[GpuCapacity, ...], sizes: list[float], policy: NodePolicy, active: list[Instance] | None = None):
    """Admit requests of these sizes one after another, each granted request
    becoming an active instance the next one must live with (as the daemon
    does). Returns the active instances."""
    active = list(active or [])
    for n, gib in enumerate(sizes):
        grants = admit(req(gib), gpus, active, policy)
        active.append(Instance(f"i{n}", OWNER, grants, InstanceState.BOUND, True))
    return active


def shape(gpus: tuple[GpuCapacity, ...], active: list[Instance]) -> str:
    """The node as `kubectl inspect cgpu` prints it: Allocated/Total GiB per GPU."""
    return " ".join(f"{u.allocated // GIB}/{u.gpu.memory // GIB}" for u in gpu_usage(gpus, active))


# --------------------------------------------------------------------------
# Requests that are wrong in themselves: UsageError, whatever the node holds


FOUR = node(15, 15, 15, 15)
TWO = node(15, 15)


@pytest.mark.parametrize(
    ("request_", "gpus", "policy", "message"),
    [
        pytest.param(
            req(4, gpu_count=0),
            TWO,
            CGPU,
            "asked for 0 GPUs: ask for at least 1 (aliyun.com/gpu-count)",
            id="no-gpu-asked",
        ),
        pytest.param(
            req(4, gpu_count=3),
            TWO,
            CGPU,
            "asked for 3 GPUs but this node has 2: ask for 2 or fewer (aliyun.com/gpu-count)",
            id="more-gpus-than-node",
        ),
        pytest.param(
            req(4), (), CGPU, "asked for 1 GPU but this node has no GPUs: run it on a GPU node", id="node-without-gpus"
        ),
        pytest.param(
            Request(OWNER, memory=-1),
            TWO,
            DEFAULT,
            "asked for -1 bytes of GPU memory: ask for a size of 0 or more (aliyun.com/gpu-mem)",
            id="negative-memory",
        ),
        *[
            pytest.param(
                req(0),
                TWO,
                NodePolicy(mode=mode),
                f"node mode {mode.value} shares GPUs by memory: ask for a memory size per GPU "
                "(aliyun.com/gpu-mem, e.g. 4 GiB) or run on a default node for whole GPUs",
                id=f"zero-memory-{mode.value}",
            )
            for mode in (NodeMode.CGPU, NodeMode.CORE_MEM, NodeMode.SHARE, NodeMode.MPS)
        ],
        *[
            pytest.param(
                req(4, core_percent=30),
                TWO,
                NodePolicy(mode=mode),
                f"node mode {mode.value} does not enforce compute shares; "
                "ask without a core percentage or run on a core_mem or mps node",
                id=f"core-share-on-{mode.value}",
            )
            for mode in (NodeMode.CGPU, NodeMode.SHARE)
        ],
        pytest.param(
            req(0, core_percent=50),
            TWO,
            DEFAULT,
            "node mode default gives whole GPUs and does not divide compute; "
            "ask without a core percentage or run on a core_mem node",
            id="core-share-on-default",
        ),
        *[
            pytest.param(
                req(4, core_percent=pct),
                TWO,
                CORE_MEM,
                f"asked for {pct}% compute: ask for 0 (no share) or a multiple of 5 from 5 to 100 "
                "(aliyun.com/gpu-core.percentage)",
                id=f"core-{pct}-percent",
            )
            for pct in (7, 105, -5, 3)
        ],
        pytest.param(
            req(4, core_percent=15),
            TWO,
            replace(CORE_MEM, core_step=10),
            "asked for 15% compute: ask for 0 (no share) or a multiple of 10 from 10 to 100 "
            "(aliyun.com/gpu-core.percentage)",
            id="core-off-a-coarser-step",
        ),
        pytest.param(
            req(4, weight=0), TWO, CGPU, "asked for weight 0: use 1 or more (ALIYUN_COM_GPU_SCHD_WEIGHT)", id="weight-0"
        ),
        pytest.param(
            req(4, priority=-1),
            TWO,
            CGPU,
            "asked for priority -1: use 0 or more (ALIYUN_COM_GPU_HIGH_PRIO)",
            id="negative-priority",
        ),
        pytest.param(
            req(16),
            TWO,
            CGPU,
            "asked for 16 GiB per GPU but the largest GPU on this node has 15 GiB: "
            "ask for 15 GiB or less (aliyun.com/gpu-mem)",
            id="larger-than-any-gpu",
        ),
        pytest.param(
            req(20, gpu_count=2),
            node(15, 24),
            CGPU,
            "asked for 2 GPUs with 20 GiB each but only 1 has that much memory: ask for fewer GPUs or less memory",
            id="too-few-gpus-large-enough",
        ),
        *[
            pytest.param(
                req(4),
                TWO,
                replace(CGPU, core_step=step),
                f"node setting core_step is {step}: set it between 1 and 100 (compute shares are multiples of it)",
                id=f"core-step-{step}",
            )
            for step in (0, 101)
        ],
        pytest.param(
            req(4),
            TWO,
            replace(CGPU, max_instances_per_gpu=0),
            "node setting max_instances_per_gpu is 0: set it to 1 or more",
            id="max-instances-0",
        ),
        pytest.param(
            req(4),
            TWO,
            NodePolicy(mode="exclusive"),  # type: ignore[arg-type]  # as read from a label
            "unknown node mode 'exclusive' (ack.node.gpu.schedule): use one of default, share, cgpu, core_mem, mps, "
            "topology",
            id="unknown-mode",
        ),
        pytest.param(
            req(4),
            TWO,
            NodePolicy(placement="pack"),  # type: ignore[arg-type]
            "unknown placement 'pack' (ack.node.gpu.placement): use binpack or spread",
            id="unknown-placement",
        ),
    ],
)
def test_bad_requests_are_usage_errors(request_, gpus, policy, message):
    with pytest.raises(UsageError) as err:
        admit(request_, gpus, [], policy)
    assert str(err.value) == message


# --------------------------------------------------------------------------
# Well-formed requests the node grants


@pytest.mark.parametrize(
    ("request_", "gpus", "policy", "grants"),
    [
        pytest.param(req(0), TWO, DEFAULT, [(0, 15, 100)], id="default-memory-0-is-a-whole-gpu"),
        pytest.param(req(4), TWO, DEFAULT, [(0, 15, 100)], id="default-any-memory-is-a-whole-gpu"),
        pytest.param(req(99), TWO, DEFAULT, [(0, 15, 100)], id="default-memory-beyond-the-gpu-is-ignored"),
        pytest.param(req(0, gpu_count=2), TWO, DEFAULT, [(0, 15, 100), (1, 15, 100)], id="default-two-whole-gpus"),
        pytest.param(req(4), TWO, CGPU, [(0, 4, 0)], id="cgpu-memory-only"),
        pytest.param(req(15), TWO, CGPU, [(0, 15, 0)], id="cgpu-exactly-a-whole-gpu"),
        pytest.param(req(4, core_percent=25), TWO, CORE_MEM, [(0, 4, 25)], id="core_mem-share"),
        pytest.param(req(4, core_percent=100), TWO, CORE_MEM, [(0, 4, 100)], id="core_mem-full-share"),
        pytest.param(req(4), TWO, CORE_MEM, [(0, 4, 0)], id="core_mem-without-share"),
        pytest.param(
            req(4, core_percent=33), TWO, replace(CORE_MEM, core_step=1), [(0, 4, 33)], id="core_step-1-any-percent"
        ),
        pytest.param(req(4, gpu_count=2), TWO, CGPU, [(0, 4, 0), (1, 4, 0)], id="memory-per-gpu-on-distinct-gpus"),
        pytest.param(req(4, weight=7, priority=3), TWO, CGPU, [(0, 4, 0)], id="weight-and-priority"),
    ],
)
def test_granted(request_, gpus, policy, grants):
    got = admit(request_, gpus, [], policy)
    assert [(g.gpu_index, g.memory / GIB, g.core_percent) for g in got] == grants
    assert [g.gpu_uuid for g in got] == [gpus[i].uuid for i, _, _ in grants]


# --------------------------------------------------------------------------
# Requests that do not fit now: AdmissionError, explaining the shortfall


def at_limit(gpu: int, count: int = 20) -> list[Instance]:
    """`count` instances of 128 MiB each on one GPU of FOUR."""
    return [held(FOUR, (gpu, 0.125, 0), name=f"g{gpu}-{k}") for k in range(count)]


@pytest.mark.parametrize(
    ("request_", "gpus", "active", "policy", "message"),
    [
        pytest.param(
            req(6),
            node(15, 15),
            [held(TWO, (0, 12, 0)), held(TWO, (1, 11, 0))],
            CGPU,
            "no GPU has 6 GiB free: most free is 4 GiB on GPU 1 (of 15 GiB); "
            "release an instance or ask for less memory",
            id="memory-single",
        ),
        pytest.param(
            req(1.5),
            node(2),
            [held(node(2), (0, 1.5 - 1 / 1024 / 2, 0))],
            CGPU,
            "no GPU has 1536 MiB free: most free is 512.5 MiB on GPU 0 (of 2 GiB); "
            "release an instance or ask for less memory",
            id="memory-in-mib",
        ),
        pytest.param(
            req(7, gpu_count=3),
            FOUR,
            [held(FOUR, (0, 15, 0)), held(FOUR, (1, 9, 0))],
            CGPU,
            "asked for 3 GPUs with 7 GiB free each but only 2 have that much: the next most free is 6 GiB on GPU 1 "
            "(of 15 GiB); release an instance, ask for fewer GPUs or ask for less memory",
            id="memory-multi",
        ),
        pytest.param(
            req(10, gpu_count=2),
            TWO,
            [held(TWO, (0, 8, 0)), held(TWO, (1, 6, 0))],
            CGPU,
            "asked for 2 GPUs with 10 GiB free each but none has that much: most free is 9 GiB on GPU 1 "
            "(of 15 GiB); release an instance, ask for fewer GPUs or ask for less memory",
            id="memory-multi-none",
        ),
        pytest.param(
            req(1),
            node(15),
            at_limit(0),
            CGPU,
            "GPU 0 already holds 20 instances, the most this node allows (max_instances_per_gpu); "
            "release one or raise the limit",
            id="max-instances-single-gpu",
        ),
        pytest.param(
            req(1),
            node(15),
            at_limit(0, 5),
            replace(CGPU, max_instances_per_gpu=3),
            "GPU 0 already holds 5 instances, more than this node now allows (max_instances_per_gpu=3); "
            "release one or raise the limit",
            id="max-instances-lowered",
        ),
        pytest.param(
            req(1),
            FOUR,
            at_limit(0) + at_limit(1) + at_limit(2) + at_limit(3),
            CGPU,
            "all 4 GPUs already hold 20 instances, the most this node allows (max_instances_per_gpu); "
            "release one or raise the limit",
            id="max-instances-every-gpu",
        ),
        pytest.param(
            req(1, gpu_count=3),
            FOUR,
            at_limit(0) + at_limit(2),
            CGPU,
            "asked for 3 GPUs but only 2 have room for another instance: GPUs 0 and 2 already hold 20 instances, "
            "the most this node allows (max_instances_per_gpu); release one, raise the limit or ask for fewer GPUs",
            id="max-instances-multi",
        ),
        pytest.param(
            req(1, core_percent=30),
            TWO,
            [held(TWO, (0, 1, 80)), held(TWO, (1, 1, 75))],
            CORE_MEM,
            "no GPU has 30% compute left: most left is 25% on GPU 1; "
            "release an instance or ask for a smaller core percentage",
            id="compute-single",
        ),
        pytest.param(
            req(1, gpu_count=2, core_percent=50),
            TWO,
            [held(TWO, (0, 1, 60))],
            CORE_MEM,
            "asked for 2 GPUs with 50% compute each but only 1 has that much left: the next most left is 40% on "
            "GPU 0; release an instance, ask for fewer GPUs or ask for a smaller core percentage",
            id="compute-multi",
        ),
        pytest.param(
            # Each constraint alone leaves a GPU, together none: GPU 0 has
            # the memory but no instance slot, GPU 1 the slot but no memory.
            req(6),
            TWO,
            [held(TWO, (0, 0.5, 0), name="a"), held(TWO, (0, 0.5, 0), name="b"), held(TWO, (1, 11, 0))],
            replace(CGPU, max_instances_per_gpu=2),
            "no GPU has all of 6 GiB free, room for another instance: the closest, GPU 0, already holds 2 "
            "instances, the most this node allows (max_instances_per_gpu); release an instance or ask for less",
            id="combination-single",
        ),
        pytest.param(
            # Two GPUs pass each constraint alone, only GPU 2 passes all three;
            # every other GPU misses two, and GPU 0 has the most free memory.
            req(6, gpu_count=2, core_percent=50),
            FOUR,
            [
                held(FOUR, (0, 0.5, 60), name="a"),
                held(FOUR, (0, 0.5, 0), name="b"),
                held(FOUR, (1, 11, 60)),
                held(FOUR, (3, 6, 0), name="c"),
                held(FOUR, (3, 6, 0), name="d"),
            ],
            replace(CORE_MEM, max_instances_per_gpu=2),
            "asked for 2 GPUs each with 6 GiB free, room for another instance and 50% compute but only 1 has all "
            "of it: the closest other, GPU 0, already holds 2 instances, the most this node allows "
            "(max_instances_per_gpu) and has only 40% compute left; release an instance or ask for fewer GPUs or less",
            id="combination-multi",
        ),
        pytest.param(
            req(0),
            node(15),
            [held(node(15), (0, 1, 0))],
            DEFAULT,
            "GPU 0 is in use and node mode default gives each container whole GPUs; release its instance or run "
            "on a node that shares GPUs (cgpu, core_mem)",
            id="default-single-gpu-busy",
        ),
        pytest.param(
            req(0),
            TWO,
            [held(TWO, (0, 15, 100)), held(TWO, (1, 15, 100), name="other")],
            DEFAULT,
            "both GPUs are in use and node mode default gives each container whole GPUs; release an instance or "
            "run on a node that shares GPUs (cgpu, core_mem)",
            id="default-every-gpu-busy",
        ),
        pytest.param(
            req(0),
            node(15),
            [held(node(15), (0, 1, 0))],
            NodePolicy(mode=NodeMode.TOPOLOGY),
            "GPU 0 is in use and node mode topology gives each container whole GPUs; release its instance or run "
            "on a node that shares GPUs (cgpu, core_mem)",
            id="topology-single-gpu-busy",
        ),
        pytest.param(
            req(0, gpu_count=4),
            FOUR,
            [held(FOUR, (2, 15, 100))],
            DEFAULT,
            "asked for 4 whole GPUs but only 3 of 4 are free (node mode default gives each container whole GPUs); "
            "release an instance or ask for fewer GPUs",
            id="default-multi",
        ),
    ],
)
def test_does_not_fit_now(request_, gpus, active, policy, message):
    with pytest.raises(AdmissionError) as err:
        admit(request_, gpus, active, policy)
    assert str(err.value) == message


# --------------------------------------------------------------------------
# Rules


def test_default_mode_skips_a_gpu_holding_anything():
    busy = [held(TWO, (0, 0.125, 0))]
    assert [g.gpu_index for g in admit(req(0), TWO, busy, DEFAULT)] == [1]


def test_topology_mode_gives_whole_gpus_as_default_does():
    topology = NodePolicy(mode=NodeMode.TOPOLOGY)
    busy = [held(TWO, (0, 0.125, 0))]
    (grant,) = admit(req(0), TWO, busy, topology)
    assert (grant.gpu_index, grant.memory, grant.core_percent) == (1, TWO[1].memory, 100)
    with pytest.raises(UsageError, match="node mode topology gives whole GPUs and does not divide compute"):
        admit(req(0, core_percent=50), TWO, [], topology)


def test_shared_request_cannot_land_on_a_gpu_held_whole():
    # A node switched from default to cgpu still books the whole-GPU grant.
    whole = [held(TWO, (0, 15, 100))]
    assert [g.gpu_index for g in admit(req(1), TWO, whole, CGPU)] == [1]


def test_released_instances_hold_nothing():
    gone = [held(node(15), (0, 15, 0), state=InstanceState.RELEASED)]
    assert admit(req(15), node(15), gone, CGPU)[0].memory == 15 * GIB
    assert admit(req(0), node(15), gone, DEFAULT)[0].gpu_index == 0


def test_reserved_instances_hold_their_grants():
    reserved = [held(node(15), (0, 15, 0), state=InstanceState.RESERVED)]
    with pytest.raises(AdmissionError):
        admit(req(1), node(15), reserved, CGPU)


@pytest.mark.parametrize("mode", [NodeMode.SHARE, NodeMode.MPS], ids=lambda m: m.value)
def test_share_and_mps_admit_exactly_like_cgpu(mode):
    sizes = [5, 5, 5, 4, 5, 1, 9, 2]
    gpus = node(15, 15, 24)
    for placement in Placement:
        theirs = run(gpus, sizes, NodePolicy(mode=mode, placement=placement))
        cgpu = run(gpus, sizes, NodePolicy(mode=NodeMode.CGPU, placement=placement))
        assert [i.grants for i in theirs] == [i.grants for i in cgpu]
    with pytest.raises(AdmissionError) as err:
        admit(req(16), gpus, run(gpus, [20], NodePolicy(mode=mode)), NodePolicy(mode=mode))
    assert str(err.value).startswith("no GPU has 16 GiB free")


def test_binpack_picks_the_fullest_gpu_that_fits():
    # GPU 1 is fuller but 4 GiB no longer fit there; GPU 2 is next fullest.
    active = [held(FOUR, (0, 2, 0)), held(FOUR, (1, 12, 0)), held(FOUR, (2, 6, 0))]
    assert [g.gpu_index for g in admit(req(4), FOUR, active, CGPU)] == [2]
    assert [g.gpu_index for g in admit(req(3), FOUR, active, CGPU)] == [1]


def test_binpack_ties_go_to_the_lowest_index():
    active = [held(FOUR, (3, 5, 0)), held(FOUR, (1, 5, 0), name="b")]
    assert [g.gpu_index for g in admit(req(1), FOUR, active, CGPU)] == [1]


def test_binpack_multi_gpu_takes_the_fullest_that_fit():
    active = [held(FOUR, (0, 1, 0)), held(FOUR, (2, 3, 0)), held(FOUR, (3, 2, 0))]
    assert [g.gpu_index for g in admit(req(4, gpu_count=2), FOUR, active, CGPU)] == [2, 3]


def test_binpack_fills_a_used_gpu_before_opening_a_smaller_empty_one():
    # Mixed GPUs: the empty 8 GiB GPU has less free memory than the 80 GiB
    # one already in use, yet binpack keeps filling the GPU it opened.
    gpus = node(8, 80)
    active = [held(gpus, (1, 10, 0))]
    assert [g.gpu_index for g in admit(req(4), gpus, active, CGPU)] == [1]


def test_spread_picks_the_most_free_memory():
    active = [held(FOUR, (0, 2, 0)), held(FOUR, (1, 1, 0)), held(FOUR, (2, 6, 0)), held(FOUR, (3, 3, 0))]
    assert [g.gpu_index for g in admit(req(1), FOUR, active, SPREAD)] == [1]
    assert [g.gpu_index for g in admit(req(1, gpu_count=3), FOUR, active, SPREAD)] == [0, 1, 3]


def test_spread_ties_go_to_the_lowest_index():
    active = [held(FOUR, (0, 5, 0)), held(FOUR, (2, 5, 0))]
    assert [g.gpu_index for g in admit(req(1), FOUR, active, SPREAD)] == [1]


def test_grants_are_sorted_by_gpu_index_whatever_the_preference():
    # Spread prefers GPU 3 (most free) then GPU 1; the answer is in index order.
    active = [held(FOUR, (0, 9, 0)), held(FOUR, (1, 2, 0)), held(FOUR, (2, 9, 0))]
    got = admit(req(1, gpu_count=2), FOUR, active, SPREAD)
    assert [g.gpu_index for g in got] == [1, 3]


def test_admission_ignores_the_order_of_the_instance_list():
    active = [held(FOUR, (k % 4, 1 + k % 3, 0), name=f"i{k}") for k in range(9)]
    for policy in (CGPU, SPREAD):
        assert admit(req(2), FOUR, active, policy) == admit(req(2), FOUR, active[::-1], policy)


# --------------------------------------------------------------------------
# The shapes ACK's documentation shows (4 GPUs of 15 GiB, `kubectl inspect cgpu`)


def test_binpack_fills_one_gpu_before_the_next():
    # 5+5+5 fill GPU 0 exactly; 4 no longer fits there and opens GPU 1,
    # where the next 5 joins it: GPUs 2 and 3 stay empty for large jobs.
    active = run(FOUR, [5, 5, 5, 4, 5], CGPU)
    assert shape(FOUR, active) == "15/15 9/15 0/15 0/15"


def test_spread_balances_across_gpus():
    # Four 4 GiB requests land one per GPU; the fifth goes to the lowest
    # index among the equally free.
    active = run(FOUR, [4, 4, 4, 4, 4], SPREAD)
    assert shape(FOUR, active) == "8/15 4/15 4/15 4/15"
    # The same requests under binpack pile onto the first GPUs instead.
    assert shape(FOUR, run(FOUR, [4, 4, 4, 4, 4], CGPU)) == "12/15 8/15 0/15 0/15"


def test_spread_steps_around_a_busy_gpu():
    # The documentation's 4/15 4/15 0/15 4/15: GPU 2 was running a 12 GiB
    # job when three 4 GiB pods arrived. Spread put them on the GPUs with
    # most free memory (0, 1, 3; GPU 2's 3 GiB could not hold one); once
    # the job ended, GPU 2 reads empty.
    job = held(FOUR, (2, 12, 0), name="job")
    active = run(FOUR, [4, 4, 4], SPREAD, active=[job])
    assert shape(FOUR, active) == "4/15 4/15 12/15 4/15"
    finished = [replace(job, state=InstanceState.RELEASED)] + active[1:]
    assert shape(FOUR, finished) == "4/15 4/15 0/15 4/15"


# --------------------------------------------------------------------------
# gpu_usage


def test_gpu_usage_sums_active_grants_per_gpu():
    gpus = node(15, 15, 15)
    active = [
        held(gpus, (0, 4, 20), (2, 4, 20), name="two-gpus"),
        held(gpus, (0, 2, 10), name="small"),
        held(gpus, (1, 9, 0), state=InstanceState.RELEASED, name="gone"),
        held(node(15, 15, 15, 15), (3, 1, 0), name="on-a-gpu-gone-from-the-inventory"),
    ]
    usage = gpu_usage(gpus, active)
    assert [(u.gpu.index, u.allocated / GIB, u.core_percent, u.instances) for u in usage] == [
        (0, 6, 30, 2),
        (1, 0, 0, 0),
        (2, 4, 20, 1),
    ]


def test_gpu_usage_counts_an_instance_once_per_gpu_and_orders_by_index():
    gpus = tuple(reversed(node(15, 15)))
    split = held(node(15, 15), (1, 2, 0), (1, 3, 0))
    usage = gpu_usage(gpus, [split])
    assert [(u.gpu.index, u.allocated / GIB, u.instances) for u in usage] == [(0, 0, 0), (1, 5, 1)]


def test_gpu_usage_refuses_two_gpus_with_one_index():
    with pytest.raises(ValueError, match="GPU index 0 is listed twice"):
        gpu_usage(node(15) + node(15), [])


# --------------------------------------------------------------------------
# Properties over random nodes and request sequences


def fits(gpu: GpuCapacity, active: list[Instance], r: Request, policy: NodePolicy) -> bool:
    """An independent statement of the fit rule, from the raw instances."""
    mine = [g for i in active if i.active for g in i.grants if g.gpu_index == gpu.index]
    count = len({i.id for i in active if i.active and any(g.gpu_index == gpu.index for g in i.grants)})
    if policy.mode in WHOLE_GPU_MODES:
        return count == 0
    return (
        gpu.memory - sum(g.memory for g in mine) >= r.memory
        and count < policy.max_instances_per_gpu
        and sum(g.core_percent for g in mine) + r.core_percent <= 100
    )


def free(gpu: GpuCapacity, active: list[Instance]) -> int:
    return gpu.memory - sum(g.memory for i in active if i.active for g in i.grants if g.gpu_index == gpu.index)


def used(gpu: GpuCapacity, active: list[Instance]) -> bool:
    return any(g.gpu_index == gpu.index for i in active if i.active for g in i.grants)


gpu_sets = st.lists(st.integers(1, 80), min_size=1, max_size=8).map(lambda sizes: node(*sizes))


@st.composite
def scenarios(draw, placement: Placement | None = None):
    """A node, its policy, and a sequence of steps: admit a request, or
    release an earlier instance (so GPUs empty and refill). A small instance
    limit makes that limit bind as often as memory and compute do."""
    gpus = draw(gpu_sets)
    policy = NodePolicy(
        mode=draw(st.sampled_from(list(NodeMode))),
        placement=placement or draw(st.sampled_from(list(Placement))),
        max_instances_per_gpu=draw(st.integers(1, 6)),
        core_step=draw(st.sampled_from([5, 10, 25])),
    )
    steps = []
    for _ in range(draw(st.integers(1, 30))):
        if draw(st.integers(0, 4)) == 0:
            steps.append(("release", draw(st.integers(0, 1000))))
            continue
        # Whole GiB as ACK asks, and MiB sizes that leave odd remainders.
        gib = st.integers(1, 40).map(lambda g: g * GIB)
        mib = st.integers(1, 20 * 1024).map(lambda m: m * MIB)
        memory = draw(st.one_of(gib, mib))
        core = 0
        if policy.mode == NodeMode.CORE_MEM:
            core = draw(st.sampled_from([0, *range(policy.core_step, 101, policy.core_step)]))
        count = draw(st.integers(1, min(3, len(gpus))))
        steps.append(("admit", Request(OWNER, memory=memory, gpu_count=count, core_percent=core)))
    return gpus, policy, steps


def replay(gpus, policy, steps, check) -> None:
    """Run the steps, calling check(request, active before, outcome) on each
    admission, where outcome is the grants or the error raised."""
    active: list[Instance] = []
    for n, (kind, arg) in enumerate(steps):
        if kind == "release":
            live = [i for i in active if i.active]
            if live:
                gone = live[arg % len(live)]
                active = [replace(i, state=InstanceState.RELEASED) if i is gone else i for i in active]
            continue
        try:
            outcome: Any = admit(arg, gpus, active, policy)
        except (AdmissionError, UsageError) as e:
            outcome = e
        check(arg, active, outcome)
        if isinstance(outcome, tuple):
            active = active + [Instance(f"i{n}", OWNER, outcome, InstanceState.BOUND, policy.mode != NodeMode.SHARE)]


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_no_gpu_is_ever_overcommitted(scenario):
    gpus, policy, steps = scenario
    limit = 1 if policy.mode in WHOLE_GPU_MODES else policy.max_instances_per_gpu

    def check(r, before, outcome):
        if not isinstance(outcome, tuple):
            return
        after = before + [Instance("new", OWNER, outcome, InstanceState.BOUND, True)]
        for u in gpu_usage(gpus, after):
            assert u.allocated <= u.gpu.memory
            assert u.core_percent <= 100
            assert u.instances <= limit

    replay(gpus, policy, steps, check)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_grants_match_the_request_and_refusals_are_justified(scenario):
    gpus, policy, steps = scenario

    def check(r, before, outcome):
        can = [g for g in gpus if fits(g, before, r, policy)]
        if isinstance(outcome, tuple):
            assert len(outcome) == r.gpu_count
            assert [g.gpu_index for g in outcome] == sorted({g.gpu_index for g in outcome})
            by_index = {g.index: g for g in gpus}
            for g in outcome:
                gpu = by_index[g.gpu_index]
                assert fits(gpu, before, r, policy)
                assert g.gpu_uuid == gpu.uuid
                if policy.mode in WHOLE_GPU_MODES:
                    assert (g.memory, g.core_percent) == (gpu.memory, 100)
                else:
                    assert (g.memory, g.core_percent) == (r.memory, r.core_percent)
        elif isinstance(outcome, AdmissionError):
            # Never refuse what fits, and say something a person can act on.
            assert len(can) < r.gpu_count
            assert "\n" not in str(outcome) and "; " in str(outcome)
        elif policy.mode is NodeMode.MPS and r.gpu_count > 1:
            # mps nodes give one GPU per container (one MPS daemon per GPU).
            assert "runs one MPS control daemon per GPU" in str(outcome)
        else:
            # Only a size no GPU here can ever hold is a usage error here.
            assert policy.mode not in WHOLE_GPU_MODES
            assert sum(1 for g in gpus if g.memory >= r.memory) < r.gpu_count
            assert "\n" not in str(outcome)

    replay(gpus, policy, steps, check)


@settings(max_examples=200, deadline=None)
@given(scenarios(Placement.BINPACK))
def test_binpack_never_opens_an_empty_gpu_while_a_used_one_fits(scenario):
    gpus, policy, steps = scenario

    def check(r, before, outcome):
        if not isinstance(outcome, tuple):
            return
        chosen = {g.gpu_index for g in outcome}
        opened = [i for i in chosen if not used(gpus[i], before)]
        passed_over = [
            g.index for g in gpus if g.index not in chosen and used(g, before) and fits(g, before, r, policy)
        ]
        assert not (opened and passed_over), f"opened {opened} while {passed_over} fit"

    replay(gpus, policy, steps, check)


@settings(max_examples=200, deadline=None)
@given(scenarios(Placement.SPREAD))
def test_spread_always_picks_the_most_free_memory(scenario):
    gpus, policy, steps = scenario

    def check(r, before, outcome):
        if not isinstance(outcome, tuple):
            return
        chosen = {g.gpu_index for g in outcome}
        others = [free(g, before) for g in gpus if g.index not in chosen and fits(g, before, r, policy)]
        for i in chosen:
            assert all(free(gpus[i], before) >= f for f in others)

    replay(gpus, policy, steps, check)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_admission_is_deterministic(scenario):
    gpus, policy, steps = scenario

    def check(r, before, outcome):
        for again in (before, list(reversed(before))):
            try:
                second: Any = admit(r, gpus, again, policy)
            except (AdmissionError, UsageError) as e:
                second = e
            if isinstance(outcome, tuple):
                assert second == outcome
            else:
                assert type(second) is type(outcome) and str(second) == str(outcome)

    replay(gpus, policy, steps, check)


# ---- by how the GPUs are joined (cgpud.node.topology) ----------------------------------

PAIR_LINKS = NVLINK_PAIRS
TOPOLOGY = NodePolicy(mode=NodeMode.TOPOLOGY)


def test_topology_mode_takes_one_gpu_from_a_broken_pair() -> None:
    gpus = node(16, 16, 16, 16)
    [g] = admit(req(0), gpus, [held(gpus, (3, 16, 0))], TOPOLOGY, links=PAIR_LINKS)
    assert g.gpu_index == 2  # 0 and 1 stay a pair for the next two-GPU request
    [g] = admit(req(0), gpus, [held(gpus, (3, 16, 0))], TOPOLOGY)
    assert g.gpu_index == 0  # without links: placement's first


def test_a_multi_gpu_request_gets_a_linked_pair_in_every_mode() -> None:
    gpus = node(16, 16, 16, 16)
    busy = [held(gpus, (1, 2, 0), name="a"), held(gpus, (2, 2, 0), name="b")]
    grants = admit(req(4, gpu_count=2), gpus, busy, CGPU, links=PAIR_LINKS)
    assert sorted(g.gpu_index for g in grants) in ([0, 1], [2, 3])
    assert sorted(g.gpu_index for g in admit(req(4, gpu_count=2), gpus, busy, CGPU)) == [1, 2]  # binpack alone
    assert sorted(g.gpu_index for g in admit(req(0, gpu_count=2), gpus, [], DEFAULT, links=PAIR_LINKS)) == [0, 1]


# ---- admit_resize: a running instance judged anew on its own GPUs ----

GPUS = node(16, 16)


def test_grow_and_shrink_in_place_keep_the_gpus() -> None:
    me = held(GPUS, (1, 4, 30), name="me")
    grants = admit_resize(me, 10 * GIB, None, GPUS, [me, held(GPUS, (1, 6, 0))], CORE_MEM)
    assert [(g.gpu_index, g.memory, g.core_percent) for g in grants] == [(1, 10 * GIB, 30)]
    grants = admit_resize(me, None, 70, GPUS, [me], CORE_MEM)
    assert [(g.gpu_index, g.memory, g.core_percent) for g in grants] == [(1, 4 * GIB, 70)]
    assert admit_resize(me, 4 * GIB, 30, GPUS, [me], CORE_MEM) == me.grants


def test_a_grow_past_what_is_free_on_its_gpu_says_what_is() -> None:
    me = held(GPUS, (0, 4, 0), name="me")
    with pytest.raises(AdmissionError) as e:
        admit_resize(me, 11 * GIB, None, GPUS, [me, held(GPUS, (0, 6, 0))], CGPU)
    assert str(e.value).startswith("cannot resize instance me to 11 GiB on GPU 0: ")
    assert "most free is 10 GiB on GPU 0" in str(e.value)


def test_compute_counts_the_neighbours_and_reservations_count_too() -> None:
    me = held(GPUS, (0, 2, 30), name="me")
    with pytest.raises(AdmissionError, match="no GPU has 60% compute left: most left is 50% on GPU 0"):
        admit_resize(me, None, 60, GPUS, [me, held(GPUS, (0, 2, 50))], CORE_MEM)
    pod = Reservation("pod-1", "ns", "p", (Share(0, 12 * GIB, 0),), expires=1e12)
    with pytest.raises(AdmissionError, match="most free is 4 GiB"):
        admit_resize(me, 5 * GIB, None, GPUS, [me], CORE_MEM, [pod])


def test_every_gpu_of_a_multi_gpu_instance_must_fit() -> None:
    me = held(GPUS, (0, 4, 0), (1, 4, 0), name="me")
    with pytest.raises(AdmissionError, match="on GPUs 0 and 1"):
        admit_resize(me, 8 * GIB, None, GPUS, [me, held(GPUS, (1, 10, 0))], CGPU)
    grants = admit_resize(me, 6 * GIB, None, GPUS, [me, held(GPUS, (1, 10, 0))], CGPU)
    assert [g.memory for g in grants] == [6 * GIB, 6 * GIB]


@pytest.mark.parametrize(
    ("memory", "core", "policy", "error", "message"),
    [
        (0, None, CGPU, UsageError, "ask for a memory size per GPU"),
        (None, 30, CGPU, UsageError, "node mode cgpu does not enforce compute shares"),
        (None, 33, CORE_MEM, UsageError, "a multiple of"),
        (2 * GIB, None, DEFAULT, UsageError, "node mode default gives whole GPUs"),
    ],
)
def test_bad_resizes_are_usage_errors(memory, core, policy, error, message) -> None:
    me = held(GPUS, (0, 4, 0), name="me")
    with pytest.raises(error, match=message):
        admit_resize(me, memory, core, GPUS, [me], policy)


def test_only_a_running_instance_resizes() -> None:
    gone = held(GPUS, (0, 4, 0), state=InstanceState.RELEASED, name="gone")
    with pytest.raises(StateError, match="instance gone is released: only a running instance can be resized"):
        admit_resize(gone, 2 * GIB, None, GPUS, [], CGPU)


def test_an_mps_client_only_shrinks_its_memory_in_place() -> None:
    mps = NodePolicy(mode=NodeMode.MPS)
    me = held(GPUS, (0, 4, 30), name="me")
    assert [g.memory for g in admit_resize(me, 2 * GIB, None, GPUS, [me], mps)] == [2 * GIB]
    with pytest.raises(UsageError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        admit_resize(me, 6 * GIB, None, GPUS, [me], mps)
    with pytest.raises(UsageError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        admit_resize(me, None, 50, GPUS, [me], mps)
