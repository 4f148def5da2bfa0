"""What a cluster scheduler decides for the node, in placement.py: the GPUs
it chose for a request (Request.gpu_indexes: those or none), and whether the
node's mode may change at runtime (policy_change_problem)."""

from __future__ import annotations

import pytest

from cgpud.node.model import GIB, GpuCapacity, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner, OwnerKind
from cgpud.node.model import Placement, Request
from cgpud.node.placement import admit, policy_change_problem
from cgpud.errors import AdmissionError, UsageError

OWNER = Owner(OwnerKind.POD, "uid/ns/pod/main")
GPUS = tuple(GpuCapacity(i, f"GPU-{i}", 16 * GIB) for i in range(3))
CGPU = NodePolicy(mode=NodeMode.CGPU)


def holding(gpu: int, gib: int, core: int = 0) -> Instance:
    return Instance(
        f"i{gpu}-{gib}",
        Owner(OwnerKind.CONTAINER, f"c{gpu}-{gib}"),
        (Grant(gpu, f"GPU-{gpu}", gib * GIB, core),),
        InstanceState.BOUND,
        True,
    )


def test_the_named_gpu_is_used_even_against_the_placement():
    busy = [holding(0, 8)]
    assert admit(Request(OWNER, 4 * GIB), GPUS, busy, CGPU)[0].gpu_index == 0  # binpack's own choice
    grants = admit(Request(OWNER, 4 * GIB, gpu_indexes=(2,)), GPUS, busy, CGPU)
    assert [(g.gpu_index, g.memory) for g in grants] == [(2, 4 * GIB)]
    two = admit(Request(OWNER, 2 * GIB, gpu_count=2, gpu_indexes=(2, 0)), GPUS, busy, CGPU)
    assert [g.gpu_index for g in two] == [0, 2]


def test_a_named_gpu_that_is_full_is_refused_with_the_schedulers_choice_named():
    with pytest.raises(
        AdmissionError,
        match=r"^the scheduler chose GPU 1: no GPU has 10 GiB free: most free is "
        r"8 GiB on GPU 1 \(of 16 GiB\)",
    ):
        admit(Request(OWNER, 10 * GIB, gpu_indexes=(1,)), GPUS, [holding(1, 8)], CGPU)
    with pytest.raises(AdmissionError, match="^the scheduler chose GPU 1: GPU 1 is in use"):
        admit(Request(OWNER, 0, gpu_indexes=(1,)), GPUS, [holding(1, 8)], NodePolicy(mode=NodeMode.DEFAULT))


@pytest.mark.parametrize(
    "request_, message",
    [
        (
            Request(OWNER, GIB, gpu_indexes=(5,)),
            "asked for GPU 5, which this node does not have (it has GPUs 0, 1 and 2)",
        ),
        (Request(OWNER, GIB, gpu_indexes=(0, 1)), "asked for 1 GPU on GPUs 0 and 1: name each of the 1 GPU once"),
        (Request(OWNER, GIB, gpu_count=2, gpu_indexes=(1, 1)), "asked for 2 GPUs on GPUs 1 and 1"),
        (Request(OWNER, 20 * GIB, gpu_indexes=(0,)), "asked for 20 GiB on GPU 0, which has 16 GiB"),
    ],
)
def test_wrong_named_gpus_are_usage_errors(request_, message):
    with pytest.raises(UsageError) as info:
        admit(request_, GPUS, [], CGPU)
    assert message in str(info.value) and not isinstance(info.value, AdmissionError)


def test_placement_changes_are_always_allowed_and_modes_only_when_nothing_breaks():
    busy = [holding(0, 4)]
    assert policy_change_problem(CGPU, NodeMode.CGPU, busy, False) is None
    assert "would break the 1 instance" in policy_change_problem(CGPU, NodeMode.MPS, busy, False, True)
    assert policy_change_problem(CGPU, NodeMode.MPS, [], False, mps_running=True) is None
    assert policy_change_problem(CGPU, NodeMode.SHARE, [], False) is None
    problem = policy_change_problem(CGPU, NodeMode.SHARE, busy, False)
    assert problem == (
        "mode share (memory bookkeeping only) would break the 1 instance granted under cgpu "
        "(memory isolation); release them (drain the node) first"
    )
    released = [Instance("x", OWNER, (Grant(0, "GPU-0", GIB, 0),), InstanceState.RELEASED, True)]
    assert policy_change_problem(CGPU, NodeMode.DEFAULT, released, False) is None


def test_mps_needs_the_mps_daemons_of_a_start():
    assert "restart cgpud to switch to mps" in policy_change_problem(CGPU, NodeMode.MPS, [], False)
    mps = NodePolicy(mode=NodeMode.MPS)
    assert "restart cgpud to switch to cgpu" in policy_change_problem(mps, NodeMode.CGPU, [], False, True)


def test_core_mem_needs_the_compute_scheduler_of_a_start():
    assert "restart cgpud to switch to core_mem" in policy_change_problem(CGPU, NodeMode.CORE_MEM, [], False)
    core = NodePolicy(mode=NodeMode.CORE_MEM, placement=Placement.SPREAD)
    assert "restart cgpud to switch to cgpu" in policy_change_problem(core, NodeMode.CGPU, [], True)
    assert policy_change_problem(core, NodeMode.CORE_MEM, [holding(0, 4, 30)], True) is None
