"""Which pod and container an Allocate is for (cgpud/kube/assignment.py):
the scheduler's annotations, oldest assumed pod first, containers one by
one, and a clear error naming the pod for every malformed annotation."""

from __future__ import annotations

import pytest

from cgpud.kube.apiserver import ContainerInfo, PodInfo
from cgpud.node.model import PodContainer
from cgpud.kube.assignment import Assignment, assumed, check_count, complete, find_asker, pod_container, resolve_memory
from cgpud.kube.model import ANNOTATION_ALLOCATION, ANNOTATION_ASSIGNED, ANNOTATION_ASSUME_TIME, ANNOTATION_GPU_INDEX
from cgpud.kube.model import AllocationError, Resource

MEM, CORE, COUNT = Resource.GPU_MEM.value, Resource.GPU_CORE.value, Resource.GPU_COUNT.value


def pod(
    name: str,
    *,
    t: int | str | None = 100,
    idx: str | None = "0",
    assigned: str | None = "false",
    containers: dict[str, dict[str, int]] | None = None,
    init: dict[str, dict[str, int]] | None = None,
    phase: str = "Pending",
    deleting: bool = False,
    extra: dict[str, str] | None = None,
) -> PodInfo:
    ann: dict[str, str] = {}
    if t is not None:
        ann[ANNOTATION_ASSUME_TIME] = str(t)
    if idx is not None:
        ann[ANNOTATION_GPU_INDEX] = idx
    if assigned is not None:
        ann[ANNOTATION_ASSIGNED] = assigned
    ann.update(extra or {})
    cs = [ContainerInfo(n, lim, True) for n, lim in (init or {}).items()]
    cs += [ContainerInfo(n, lim) for n, lim in (containers or {"main": {MEM: 2}}).items()]
    return PodInfo(f"uid-{name}", "ns", name, "node-1", phase, ann, tuple(cs), deleting)


def resolve(pods, gib, node, held) -> Assignment:
    return resolve_memory(pods, gib, node, held).assignment


def test_the_oldest_assumed_pod_of_that_size_is_chosen():
    pods = [pod("young", t=300), pod("old", t=100, idx="1"), pod("other-size", t=50, containers={"c": {MEM: 4}})]
    got = resolve(pods, 2, "node-1", set())
    assert got == Assignment(pods[1], "main", 2, 1, 0, (1,))
    # Once it holds its instance the next oldest is next.
    assert resolve(pods, 2, "node-1", {got.owner.owner_id}).pod.name == "young"


def test_assigned_finished_and_deleting_pods_are_not_candidates():
    pods = [
        pod("a", assigned="true"),
        pod("b", phase="Succeeded"),
        pod("c", deleting=True),
        pod("d", t=None),
        pod("e", assigned=None, t=5),
    ]
    assert resolve(pods, 2, "node-1", set()).pod.name == "e"  # ASSIGNED absent counts as not assigned


def test_no_assumed_pod_is_a_clear_error_that_names_the_node_and_a_pod_without_assumption():
    with pytest.raises(
        AllocationError,
        match=r"no pod on node node-1 is assumed for 2 GiB of aliyun.com/gpu-mem: "
        r"is the cgpu scheduler extender \(or gpushare\) configured\? \(pod ns/bare asks for it but "
        r"carries no ALIYUN_COM_GPU_MEM_ASSUME_TIME\)",
    ):
        resolve([pod("bare", t=None, idx=None, assigned=None)], 2, "node-1", set())
    with pytest.raises(AllocationError, match="no pod on node node-1 is assumed for 3 GiB"):
        resolve([pod("a")], 3, "node-1", set())


@pytest.mark.parametrize(
    "annotations, needle",
    [
        ({ANNOTATION_ASSUME_TIME: "yesterday"}, "ALIYUN_COM_GPU_MEM_ASSUME_TIME='yesterday' is not a Unix time"),
        ({ANNOTATION_GPU_INDEX: "first"}, "ALIYUN_COM_GPU_MEM_IDX='first' is not a GPU index"),
        ({ANNOTATION_GPU_INDEX: "-1"}, "ALIYUN_COM_GPU_MEM_IDX='-1' is not a GPU index"),
        ({ANNOTATION_GPU_INDEX: "0,1"}, "asks for 1 GPUs but annotation ALIYUN_COM_GPU_MEM_IDX='0,1' names 2"),
        ({ANNOTATION_ALLOCATION: "{not json"}, "scheduler.framework.gpushare.allocation='{not json' is not"),
        ({ANNOTATION_ALLOCATION: '{"0": {"0": "x"}}'}, "scheduler.framework.gpushare.allocation="),
        ({ANNOTATION_ALLOCATION: '{"0": {"0": 1.5}}'}, "scheduler.framework.gpushare.allocation="),
        ({ANNOTATION_ALLOCATION: '{"0": {"0": 3}}'}, "gives it 3 GiB on GPU 0 but it asks for 2 GiB"),
        ({ANNOTATION_ALLOCATION: "[1]"}, 'is not {"<container index>"'),
    ],
)
def test_a_malformed_annotation_names_the_pod_and_the_annotation(annotations, needle):
    bad = pod("bad", extra=annotations)
    with pytest.raises(AllocationError, match="pod ns/bad") as info:
        resolve([bad], 2, "node-1", set())
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "annotations",
    [
        {ANNOTATION_ASSUME_TIME: "yesterday"},
        {ANNOTATION_GPU_INDEX: "first"},
        {ANNOTATION_ALLOCATION: "{not json"},
    ],
)
def test_a_pod_with_an_unparseable_annotation_is_passed_over_not_a_block_on_its_size(annotations):
    """One bad (or hostile) pod, older than the rest, must not fail every
    Allocate of its size on the node: it is skipped and named."""
    bad = pod("bad", t=1, extra=annotations)
    got = resolve_memory([bad, pod("good", t=500)], 2, "node-1", set())
    assert got.assignment.pod.name == "good"
    assert [s.pod.name for s in got.skipped] == ["bad"] and "pod ns/bad" in got.skipped[0].reason
    # alone, it is still a clear error naming it
    with pytest.raises(AllocationError, match="passed over: pod ns/bad"):
        resolve_memory([bad], 2, "node-1", set())


def test_containers_are_allocated_one_by_one_and_the_pod_completes_with_the_last():
    p = pod("multi", containers={"a": {MEM: 2}, "sidecar": {}, "b": {MEM: 2}}, init={"setup": {MEM: 2}})
    held: set[str] = set()
    order = []
    for _ in range(3):
        got = resolve([p], 2, "node-1", held)
        order.append(got.container)
        assert not complete(p, held)
        held.add(got.owner.owner_id)
    assert order == ["setup", "a", "b"]  # init containers first, as the kubelet admits them
    assert complete(p, held)
    with pytest.raises(AllocationError, match="no pod on node node-1 is assumed"):
        resolve([p], 2, "node-1", held)


def test_multi_gpu_allocation_annotation_gives_gpus_and_memory_per_gpu():
    p = pod(
        "mg",
        idx=None,
        containers={"a": {MEM: 1}, "b": {MEM: 8, COUNT: 2}},
        extra={ANNOTATION_ALLOCATION: '{"0": {"1": 1}, "1": {"0": 4, "3": 4}}'},
    )
    got = resolve([p], 8, "node-1", set())
    assert (got.container, got.gpu_indexes, got.gpu_count, got.memory_gib) == ("b", (0, 3), 2, 4)
    first = resolve([p], 1, "node-1", set())
    assert (first.container, first.gpu_indexes, first.memory_gib) == ("a", (1,), 1)


def test_unequal_split_across_gpus_is_refused():
    p = pod(
        "mg", idx=None, containers={"b": {MEM: 6, COUNT: 2}}, extra={ANNOTATION_ALLOCATION: '{"0": {"0": 2, "1": 4}}'}
    )
    with pytest.raises(AllocationError, match="same memory on each GPU"):
        resolve([p], 6, "node-1", set())


def test_without_an_index_the_node_placement_chooses_and_core_is_read_from_the_spec():
    p = pod("free", idx=None, containers={"main": {MEM: 4, CORE: 30}})
    got = resolve([p], 4, "node-1", set())
    assert (got.gpu_indexes, got.core_percent, got.memory_gib) == ((), 30, 4)


def test_core_and_count_allocates_find_the_asking_pod_even_after_it_is_assigned():
    p = pod("c", assigned="true", containers={"main": {MEM: 4, CORE: 30, COUNT: 1}})
    assert find_asker([p], Resource.GPU_CORE, 30, "node-1")[1].name == "main"
    assert find_asker([p], Resource.GPU_COUNT, 1, "node-1")[0] is p
    with pytest.raises(
        AllocationError, match="no pod on node node-1 is assumed for 40 percent of aliyun.com/gpu-core.percentage"
    ):
        find_asker([p], Resource.GPU_CORE, 40, "node-1")
    core_only = pod("k", containers={"main": {CORE: 30}})
    with pytest.raises(
        AllocationError, match="asks for 30 percent of aliyun.com/gpu-core.percentage but no aliyun.com/gpu-mem"
    ):
        find_asker([core_only], Resource.GPU_CORE, 30, "node-1")


def test_owner_ids_round_trip_and_reject_other_shapes():
    p = pod("x")
    owner = pod_container(p, "main")
    assert owner.owner_id == "uid-x/ns/x/main"
    assert PodContainer.parse(owner.owner_id) == owner
    assert PodContainer.parse("uid-x/main") is None and PodContainer.parse("a//b/c") is None
    assert assumed(p) and not assumed(pod("y", assigned="TRUE"))


def test_device_counts():
    assert check_count(["a", "b"], Resource.GPU_MEM) == 2
    with pytest.raises(AllocationError, match="names no devices"):
        check_count([], Resource.GPU_MEM)
    with pytest.raises(AllocationError, match="names a device twice"):
        check_count(["a", "a"], Resource.GPU_MEM)
