"""fit.py: the extender's filter and prioritize on a node's view (what the
node itself admits: tests/extender/test_admission.py)."""

from __future__ import annotations

import json
import pytest

from cgpud.node.model import Share
from cgpud.extender.fit import MAX_SCORE, Placement, Reason, annotations, fit, score, shares, summarize
from cgpud.extender.pod import pod_demand
from cgpud.kube import assignment
from cgpud.kube.apiserver import ContainerInfo, PodInfo
from tests.harness.extender_nodes import GIB, container, gpu, node, pod


def demand(*containers: dict, init: tuple = ()):  # type: ignore[no-untyped-def]
    return pod_demand(pod(containers=list(containers) or [container("c", mem="4")], init=init))


def placed(answer: Placement | Reason) -> Placement:
    assert isinstance(answer, Placement), answer
    return answer


def refused(answer: Placement | Reason) -> Reason:
    assert isinstance(answer, Reason), answer
    return answer


# ---- modes ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["default", "topology"])
def test_whole_gpu_nodes_take_no_shares(mode: str) -> None:
    r = refused(fit(demand(), node(mode=mode)))
    assert f"node mode {mode} gives whole GPUs" in r.text and not r.resolvable


@pytest.mark.parametrize("mode", ["share", "cgpu", "core_mem", "mps"])
def test_sharing_modes_take_memory_shares(mode: str) -> None:
    assert placed(fit(demand(), node(mode=mode))).gpus in ((0,), (1,))


def test_unknown_mode_is_refused() -> None:
    assert "unknown node mode 'weird'" in refused(fit(demand(), node(mode="weird"))).text


@pytest.mark.parametrize("mode", ["share", "cgpu"])
def test_compute_share_needs_core_mem_or_mps(mode: str) -> None:
    r = refused(fit(demand(container("c", mem="2", core="30")), node(mode=mode)))
    assert f"node mode {mode} does not enforce compute shares" in r.text and not r.resolvable


def test_mps_takes_a_compute_share_and_one_gpu_per_container() -> None:
    assert placed(fit(demand(container("c", mem="2", core="30")), node(mode="mps"))).gpus in ((0,), (1,))
    r = refused(fit(demand(container("c", mem="2", count="2")), node(mode="mps")))
    assert "runs one MPS control daemon per GPU" in r.text and not r.resolvable


def test_compute_share_on_core_mem() -> None:
    p = placed(fit(demand(container("c", mem="2", core="30")), node(mode="core_mem")))
    assert p.containers == ((2 * GIB, 30, (0,)),)


def test_compute_share_must_match_the_nodes_core_step() -> None:
    d = demand(container("c", mem="2", core="15"))
    r = refused(fit(d, node(mode="core_mem", core_step=10)))
    assert "a multiple of 10 from 10 to 100" in r.text and not r.resolvable
    assert placed(fit(d, node(mode="core_mem", core_step=5)))


# ---- per GPU constraints ----------------------------------------------------------------


def test_memory_free_per_gpu_not_in_total() -> None:
    # 3 x 4 GiB free = 12 GiB on the node, but no GPU has 10.
    n = node(gpus=[gpu(i, 16, 12) for i in range(3)])
    r = refused(fit(demand(container("c", mem="10")), n))
    assert r.resolvable and "no GPU has 10 GiB free: most free is 4 GiB on GPU 0 (of 16 GiB)" in r.text


def test_larger_than_any_gpu_is_unresolvable() -> None:
    r = refused(fit(demand(container("c", mem="20")), node()))
    assert not r.resolvable and "the largest GPU on this node has 16 GiB" in r.text


def test_more_gpus_than_the_node_has() -> None:
    r = refused(fit(demand(container("c", mem="6", count="3")), node()))
    assert not r.resolvable and "asked for 3 GPUs but this node has 2" in r.text


def test_instance_room() -> None:
    n = node(gpus=[gpu(0, used=1, instances=2, max_instances=2), gpu(1, used=1, instances=1, max_instances=2)])
    assert placed(fit(demand(container("c", mem="1")), n)).gpus == (1,)
    full = node(gpus=[gpu(0, used=1, instances=2, max_instances=2)])
    assert "GPU 0 already holds 2 instances, the most" in refused(fit(demand(container("c", mem="1")), full)).text


def test_core_at_most_100_per_gpu() -> None:
    n = node(mode="core_mem", gpus=[gpu(0, used=1, core=80), gpu(1, used=1, core=50)])
    assert placed(fit(demand(container("c", mem="1", core="30")), n)).gpus == (1,)
    r = refused(fit(demand(container("c", mem="1", core="60")), n))
    assert "no GPU has 60% compute left: most left is 50% on GPU 1" in r.text


def test_unhealthy_gpus_never() -> None:
    n = node(gpus=[gpu(0, used=4), gpu(1, healthy=False, reason="Xid 79")])
    assert placed(fit(demand(container("c", mem="4")), n)).gpus == (0,)
    r = refused(fit(demand(container("c", mem="4", count="2")), n))
    assert not r.resolvable and "only 1 of 2 are healthy (GPU 1 is unhealthy: Xid 79)" in r.text
    sick = node(gpus=[gpu(0, healthy=False, reason="lost")])
    assert "healthy" in refused(fit(demand(), sick)).text


def test_several_gpus_each_with_its_part() -> None:
    n = node(gpus=[gpu(0, used=14), gpu(1, used=8), gpu(2, used=4)])
    p = placed(fit(demand(container("c", mem="16", count="2")), n))
    assert p.containers == ((8 * GIB, 0, (1, 2)),)
    r = refused(fit(demand(container("c", mem="24", count="2")), n))
    assert "asked for 2 GPUs with 12 GiB free each but only 1 has that much" in r.text


# ---- placement order ---------------------------------------------------------------------


def test_binpack_takes_gpus_with_instances_first_then_least_free() -> None:
    # GPU 2 is empty with less free memory than GPU 0 holds free: binpack
    # still prefers the used GPUs, the least free of them.
    n = node(gpus=[gpu(0, 32, 8), gpu(1, 16, 6), gpu(2, 8, 0)])
    assert placed(fit(demand(container("c", mem="4")), n)).gpus == (1,)
    assert placed(fit(demand(container("c", mem="12")), n)).gpus == (0,)


def test_spread_takes_most_free_then_lowest_index() -> None:
    n = node(placement="spread", gpus=[gpu(0, used=4), gpu(1, used=2), gpu(2, used=2)])
    assert placed(fit(demand(), n)).gpus == (1,)


def test_containers_are_placed_in_order_on_a_working_copy() -> None:
    # Binpack: the second container goes on the GPU the first just used.
    n = node(gpus=[gpu(0), gpu(1)])
    p = placed(fit(demand(container("a", mem="4"), container("b", mem="4")), n))
    assert p.containers == ((4 * GIB, 0, (0,)), (4 * GIB, 0, (0,)))
    # Spread: the second goes where more is free after the first.
    p = placed(fit(demand(container("a", mem="4"), container("b", mem="4")), node(placement="spread")))
    assert p.containers == ((4 * GIB, 0, (0,)), (4 * GIB, 0, (1,)))
    # The working copy holds the first container: 12 + 8 GiB do not both fit one 16 GiB GPU.
    p = placed(fit(demand(container("a", mem="12"), container("b", mem="8")), n))
    assert p.containers == ((12 * GIB, 0, (0,)), (8 * GIB, 0, (1,)))
    one = node(gpus=[gpu(0)])
    r = refused(fit(demand(container("a", mem="12"), container("b", mem="8")), one))
    assert "container b no GPU has 8 GiB free" in r.text and "beside the pod's 1 container(s)" in r.text


def test_instance_room_counts_the_pods_own_containers() -> None:
    n = node(gpus=[gpu(0, max_instances=1), gpu(1, max_instances=1)])
    p = placed(fit(demand(container("a", mem="1"), container("b", mem="1")), n))
    assert p.gpus == (0, 1)
    assert isinstance(fit(demand(*[container(f"c{i}", mem="1") for i in range(3)]), n), Reason)


# ---- cache ------------------------------------------------------------------------------------


def test_a_summary_answers_the_same_shape_from_its_cache() -> None:
    s = summarize(node())
    a = fit(demand(container("c", mem="4")), s)
    b = fit(pod_demand(pod("other", [container("x", mem="4")])), s)
    assert a is b and len(s.cache) == 1
    assert fit(demand(container("c", mem="6")), s) is not a


# ---- score ---------------------------------------------------------------------------------------


def test_binpack_scores_the_fuller_end_higher_and_spread_the_emptier() -> None:
    d = demand(container("c", mem="4"))
    busy = placed(fit(d, node(gpus=[gpu(0, used=10)])))
    idle = placed(fit(d, node(gpus=[gpu(0)])))
    assert score(busy) > score(idle)
    assert score(busy) == round(MAX_SCORE * 14 / 16) and score(idle) == round(MAX_SCORE * 4 / 16)
    busy_s = placed(fit(d, node(placement="spread", gpus=[gpu(0, used=10)])))
    idle_s = placed(fit(d, node(placement="spread", gpus=[gpu(0)])))
    assert score(idle_s) > score(busy_s)
    full = placed(fit(demand(container("c", mem="16")), node(gpus=[gpu(0)])))
    assert score(full) == MAX_SCORE and 0 <= score(idle_s) <= MAX_SCORE


# ---- shares and annotations -------------------------------------------------------------------------


def test_shares_sum_per_gpu_with_one_slot_per_container() -> None:
    p = placed(
        fit(
            demand(container("a", mem="4", core="10"), container("b", mem="8", count="2", core="20")),
            node(mode="core_mem", gpus=[gpu(0), gpu(1)]),
        )
    )
    assert p.containers == ((4 * GIB, 10, (0,)), (4 * GIB, 20, (0, 1)))
    assert shares(p) == (Share(0, 8 * GIB, 30, 2), Share(1, 4 * GIB, 20, 1))


def _pod_info(p: dict, notes: dict[str, str]) -> PodInfo:  # type: ignore[type-arg]
    containers = []
    for init, key in ((True, "initContainers"), (False, "containers")):
        for c in p["spec"].get(key, []):
            limits = {k: int(v) for k, v in c.get("resources", {}).get("limits", {}).items()}
            containers.append(ContainerInfo(c["name"], limits, init))
    m = p["metadata"]
    return PodInfo(m["uid"], m["namespace"], m["name"], node="n1", annotations=notes, containers=tuple(containers))


def _resolve_all(p: dict, notes: dict[str, str]) -> dict[str, tuple[tuple[int, ...], int]]:  # type: ignore[type-arg]
    """What the device plugin makes of the annotations, container by container."""
    info = _pod_info(p, notes)
    held: set[str] = set()
    out = {}
    for c in assignment.gpu_containers(info):
        a = assignment.resolve_memory([info], c.limit(assignment.Resource.GPU_MEM), "n1", held).assignment
        held.add(a.owner.owner_id)
        out[a.container] = (a.gpu_indexes, a.memory_gib)
    return out


def test_annotations_one_container_one_gpu() -> None:
    p = pod(containers=[container("c", mem="4")])
    d = pod_demand(p)
    n = node(gpus=[gpu(0, 16), gpu(1, 24, 2)])
    pl = placed(fit(d, n))
    notes = annotations(d, pl, n, 123)
    assert notes == {
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "ALIYUN_COM_GPU_MEM_POD": "4",
        "ALIYUN_COM_GPU_MEM_DEV": "24",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "123",
        "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
    }
    assert _resolve_all(p, notes) == {"c": ((1,), 4)}


def test_annotations_several_gpus_and_containers_resolve_to_the_same_gpus() -> None:
    p = pod(containers=[container("side"), container("a", mem="8", count="2"), container("b", mem="2")])
    d = pod_demand(p)
    n = node(placement="spread", gpus=[gpu(0), gpu(1, used=2), gpu(2, used=4)])
    pl = placed(fit(d, n))
    notes = annotations(d, pl, n, 1)
    alloc = json.loads(notes["scheduler.framework.gpushare.allocation"])
    assert alloc == {"1": {str(i): 4 for i in pl.containers[0][2]}, "2": {str(i): 2 for i in pl.containers[1][2]}}
    assert notes["ALIYUN_COM_GPU_MEM_POD"] == "10"
    got = _resolve_all(p, notes)
    assert got == {"a": (pl.containers[0][2], 4), "b": (pl.containers[1][2], 2)}


def test_annotations_single_init_container_on_two_gpus() -> None:
    p = pod(containers=[container("main")], init=[container("init", mem="4", count="2")])
    d = pod_demand(p)
    n = node(gpus=[gpu(0), gpu(1), gpu(2, used=1)])
    pl = placed(fit(d, n))
    notes = annotations(d, pl, n, 1)
    assert "scheduler.framework.gpushare.allocation" not in notes
    assert _resolve_all(p, notes) == {"init": (pl.gpus, 2)}


# ---- topology: how the node's GPUs are joined (its Capacity view's links) ----------------

# Two NVLink pairs, (0, 1) and (2, 3), on two sockets; GPU 0 holds a share.
PAIRS = [(0, 1, 40, 2), (2, 3, 40, 2), (0, 2, 50, 0), (0, 3, 50, 0), (1, 2, 50, 0), (1, 3, 50, 0)]


def test_a_two_gpu_share_goes_to_a_linked_pair_not_binpacks_first_gpus() -> None:
    gpus = [gpu(0, used=2), gpu(1), gpu(2), gpu(3, used=1)]
    two = demand(container("c", mem="4", count="2"))
    assert placed(fit(two, node(gpus=gpus))).gpus == (0, 3)  # placement alone: the fuller GPUs
    # Both pairs are as good; binpack takes the one with the fuller GPU.
    assert placed(fit(two, node(gpus=gpus, links=PAIRS))).gpus == (0, 1)


def test_equally_joined_gpus_keep_placements_choice() -> None:
    flat = [(a, b, 50, 0) for a in range(4) for b in range(a + 1, 4)]
    gpus = [gpu(0, used=2), gpu(1), gpu(2), gpu(3, used=1)]
    two = demand(container("c", mem="4", count="2"))
    assert placed(fit(two, node(gpus=gpus, links=flat))).gpus == (0, 3)


# ---- whole GPUs (aliyun.com/gpu) on topology nodes --------------------------------------


def whole(n: int = 2) -> object:
    return pod_demand(pod(containers=[{"name": "c", "image": "x", "resources": {"limits": {"aliyun.com/gpu": n}}}]))


def test_whole_gpus_go_to_topology_nodes_only() -> None:
    r = refused(fit(whole(), node(mode="cgpu")))
    assert "node mode cgpu does not give aliyun.com/gpu" in r.text and not r.resolvable


def test_whole_gpus_take_the_linked_pair_and_score_how_well_it_is_joined() -> None:
    gpus = [gpu(0, used=16), gpu(1), gpu(2), gpu(3)]  # GPU 0 held (a pod's whole GPU, as the view counts it)
    p = placed(fit(whole(2), node(gpus=gpus, mode="topology", links=PAIRS)))
    assert p.containers == ((0, 0, (2, 3)),)
    assert score(p) == MAX_SCORE  # joined as well as the node's best pair
    flat = [(a, b, 50, 0) for a in range(4) for b in range(a + 1, 4)]
    weak = placed(fit(whole(2), node(gpus=gpus, mode="topology", links=flat)))
    assert weak.containers == ((0, 0, (1, 2)),) and score(weak) == MAX_SCORE  # all alike: as good as any


def test_a_node_whose_free_gpus_are_worse_joined_scores_lower() -> None:
    held_pair = [gpu(0), gpu(1), gpu(2, used=16), gpu(3)]  # 2 held: no linked pair left
    p = placed(fit(whole(2), node(gpus=held_pair, mode="topology", links=PAIRS)))
    assert p.containers == ((0, 0, (0, 1)),) and score(p) == MAX_SCORE
    broken = [gpu(0, used=16), gpu(1), gpu(2, used=16), gpu(3)]
    q = placed(fit(whole(2), node(gpus=broken, mode="topology", links=PAIRS)))
    assert q.containers == ((0, 0, (1, 3)),) and score(q) < MAX_SCORE // 2


def test_more_whole_gpus_than_are_free_is_refused_with_the_count() -> None:
    gpus = [gpu(0, used=16), gpu(1), gpu(2), gpu(3)]
    r = refused(fit(whole(4), node(gpus=gpus, mode="topology", links=PAIRS)))
    assert "asked for 4 whole GPUs but only 3 of 4 are free" in r.text
