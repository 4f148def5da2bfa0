"""One admission: the extender's answer for a node, read from that node's
Capacity view, is what the node's InstanceService admits, container by
container, and the Reserve the extender would send is held there."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cgpud.api.capacity import CapacityServicer, NodeFacts
from cgpud.errors import AdmissionError, CgpuError, StateError
from cgpud.extender.fit import Placement, Reason, fit, shares, summarize
from cgpud.extender.model import NodeState, node_from_pb
from cgpud.extender.pod import PodDemand, pod_demand
from cgpud.extender.state import Hold, with_holds
from cgpud.node.model import GIB, GpuCapacity, NodeMode, NodePolicy, Owner, OwnerKind, PodContainer, Request, Share
from cgpud.node.model import Placement as NodePlacement
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from tests.harness.extender_nodes import container, pod


@dataclass(frozen=True)
class Case:
    """A node (its GPUs in GiB, settings, what it already holds) and a pod."""

    containers: Sequence[dict]  # type: ignore[type-arg]
    sizes: Sequence[int] = (16, 16)
    mode: NodeMode = NodeMode.CGPU
    placement: NodePlacement = NodePlacement.BINPACK
    max_instances: int = 10
    core_step: int = 5
    # (GiB per GPU, GPU indexes, core percent) of instances already there
    held: Sequence[tuple[int, tuple[int, ...], int]] = ()
    # (GiB, GPU index) of reservations already there
    reserved: Sequence[tuple[int, int]] = field(default_factory=tuple)


def _node(path: Path, case: Case) -> InstanceService:
    gpus = tuple(GpuCapacity(i, f"GPU-{i}", size * GIB) for i, size in enumerate(case.sizes))
    policy = NodePolicy(
        mode=case.mode, placement=case.placement, max_instances_per_gpu=case.max_instances, core_step=case.core_step
    )
    svc = InstanceService(Store(path / "cgpud.db"), gpus, policy, path / "regions", "580", "boot")
    for k, (gib, idx, core) in enumerate(case.held):
        svc.create(Request(Owner(OwnerKind.PROCESS, f"held-{k}"), gib * GIB, len(idx), core, gpu_indexes=idx))
    for k, (gib, index) in enumerate(case.reserved):
        svc.reserve(f"other-{k}", "ns", f"other-{k}", [Share(index, gib * GIB)])
    return svc


def _view(svc: InstanceService) -> NodeState:
    facts = NodeFacts("n1", ("10.0.0.1",))
    return node_from_pb(CapacityServicer(svc, facts).view())


def _admitted(
    svc: InstanceService, demand: PodDemand, reservation: str = "", chosen: Sequence[tuple[int, ...]] = ()
) -> tuple[tuple[int, ...], ...] | CgpuError:
    """What the node grants the pod's containers one after the other (as
    their Allocates come), or its error."""
    out = []
    for k, c in enumerate(demand.containers):
        owner = Owner(OwnerKind.POD, PodContainer(demand.uid, demand.namespace, demand.name, c.name).owner_id)
        request = Request(
            owner,
            c.memory_per_gpu,
            c.gpu_count,
            c.core_percent,
            gpu_indexes=chosen[k] if chosen else (),
            reservation=reservation,
        )
        try:
            out.append(tuple(g.gpu_index for g in svc.create(request).grants))
        except CgpuError as e:
            return e
    return tuple(out)


CASES = {
    "binpack takes the used GPU": Case([container("c", mem="4")], held=[(4, (1,), 0)]),
    "spread takes the emptier GPU": Case(
        [container("c", mem="4")], placement=NodePlacement.SPREAD, held=[(4, (1,), 0)]
    ),
    "binpack fills a busy GPU before an empty one, mixed sizes": Case(
        [container("c", mem="4")], sizes=(32, 16, 8), held=[(24, (0,), 0), (10, (1,), 0)]
    ),
    "share mode": Case([container("c", mem="6")], mode=NodeMode.SHARE, held=[(12, (0,), 0)]),
    "mps mode": Case([container("c", mem="6")], mode=NodeMode.MPS),
    "core_mem: compute left decides": Case(
        [container("c", mem="2", core="30")], mode=NodeMode.CORE_MEM, held=[(1, (0,), 80), (1, (1,), 50)]
    ),
    "core_mem: no GPU has the compute": Case(
        [container("c", mem="2", core="60")], mode=NodeMode.CORE_MEM, held=[(1, (0,), 80), (1, (1,), 50)]
    ),
    "core_mem: not a multiple of the step": Case(
        [container("c", mem="2", core="15")], mode=NodeMode.CORE_MEM, core_step=10
    ),
    "compute share on a cgpu node": Case([container("c", mem="2", core="30")]),
    "memory per GPU, not in total": Case(
        [container("c", mem="10")], sizes=(16, 16, 16), held=[(12, (0,), 0), (12, (1,), 0), (12, (2,), 0)]
    ),
    "larger than any GPU": Case([container("c", mem="20")]),
    "more GPUs than the node has": Case([container("c", mem="6", count="3")]),
    "several GPUs, each with its part": Case(
        [container("c", mem="16", count="2")], sizes=(16, 16, 16), held=[(14, (0,), 0), (8, (1,), 0), (4, (2,), 0)]
    ),
    "several GPUs, too few with room": Case(
        [container("c", mem="24", count="2")], sizes=(16, 16, 16), held=[(14, (0,), 0), (8, (1,), 0), (4, (2,), 0)]
    ),
    "spread over several GPUs": Case(
        [container("c", mem="8", count="2")], sizes=(16, 16, 16), placement=NodePlacement.SPREAD, held=[(4, (1,), 0)]
    ),
    "full GPUs": Case([container("c", mem="1")], held=[(16, (0,), 0), (16, (1,), 0)]),
    "instance limit": Case([container("c", mem="1")], max_instances=2, held=[(1, (0,), 0), (1, (0,), 0), (1, (1,), 0)]),
    "every GPU at its instance limit": Case(
        [container("c", mem="1")], max_instances=1, held=[(1, (0,), 0), (1, (1,), 0)]
    ),
    "containers placed in order, binpack": Case([container("a", mem="4"), container("b", mem="4")]),
    "containers placed in order, spread": Case(
        [container("a", mem="4"), container("b", mem="4")], placement=NodePlacement.SPREAD
    ),
    "the second container beside the first": Case([container("a", mem="12"), container("b", mem="8")]),
    "the second container does not fit beside the first": Case(
        [container("a", mem="12"), container("b", mem="8")], sizes=(16,)
    ),
    "instance room counts the pod's own containers": Case(
        [container("a", mem="1"), container("b", mem="1")], max_instances=1
    ),
    "a reservation the view shows": Case([container("c", mem="10")], reserved=[(10, 0)]),
    "core_mem, several containers and GPUs": Case(
        [container("a", mem="4", core="10"), container("b", mem="8", count="2", core="20")],
        sizes=(16, 16, 16),
        mode=NodeMode.CORE_MEM,
        held=[(2, (2,), 90)],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_extender_answers_what_the_node_admits(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    demand = pod_demand(pod(containers=list(case.containers)))
    store = tmp_path / "node"
    svc = _node(store, case)
    ours = fit(demand, summarize(_view(svc)))
    theirs = _admitted(svc, demand)
    if isinstance(theirs, CgpuError):
        assert isinstance(ours, Reason), (theirs, ours)
        assert str(theirs) in ours.text
        assert ours.resolvable == isinstance(theirs, AdmissionError)
        return
    assert isinstance(ours, Placement), (theirs, ours)
    assert tuple(idx for _, _, idx in ours.containers) == theirs
    # The bind's Reserve is held, and the pod's Allocates draw on it on the GPUs chosen.
    again = _node(tmp_path / "again", case)
    again.reserve(demand.uid, demand.namespace, demand.name, shares(ours))
    assert _admitted(again, demand, demand.uid, theirs) == theirs


def test_a_reservation_not_yet_in_the_view_counts_as_the_node_counts_it(tmp_path: Path) -> None:
    case = Case([container("c", mem="10")])
    svc = _node(tmp_path, case)
    stale = _view(svc)  # taken before the extender's own Reserve shows
    svc.reserve("earlier", "ns", "earlier", [Share(0, 10 * GIB)])
    hold = Hold("earlier", "ns", "earlier", (Share(0, 10 * GIB),), "", 0, 1e12)
    demand = pod_demand(pod(containers=list(case.containers)))
    ours = fit(demand, summarize(with_holds(stale, [hold])))
    assert summarize(with_holds(stale, [hold])).usage == summarize(_view(svc)).usage
    assert isinstance(ours, Placement) and ours.gpus == (1,)
    assert _admitted(svc, demand) == ((1,),)


@pytest.mark.parametrize("mode", [NodeMode.DEFAULT, NodeMode.TOPOLOGY])
def test_a_whole_gpu_node_is_refused_as_its_reserve_refuses(tmp_path: Path, mode: NodeMode) -> None:
    svc = _node(tmp_path, Case([], mode=mode))
    ours = fit(pod_demand(pod()), summarize(_view(svc)))
    with pytest.raises(StateError) as refused:
        svc.reserve("u", "ns", "p", [Share(0, 4 * GIB)])
    assert isinstance(ours, Reason) and ours.text == str(refused.value) and not ours.resolvable
