"""Which running pod instances a pod's annotations resize, and which
requests are refused before they reach the node's admission
(cgpud.kube.pod_resize)."""

from __future__ import annotations

from cgpud.kube.apiserver import PodInfo
from cgpud.kube.pod_resize import Asked, asked, pod_resizes
from cgpud.node.model import GIB, Grant, Instance, InstanceState, Owner, OwnerKind, PodContainer


def pod(uid: str = "u1", priority: int = 0, **annotations: str) -> PodInfo:
    return PodInfo(uid, "ns", f"pod-{uid}", annotations=dict(annotations), priority=priority)


def instance(uid: str = "u1", container: str = "main", gib: int = 4, core: int = 30, **kw: object) -> Instance:
    owner = Owner(OwnerKind.POD, PodContainer(uid, "ns", f"pod-{uid}", container).owner_id)
    return Instance(
        f"cgpu-{uid}-{container}",
        owner,
        (Grant(0, "GPU-0", gib * GIB, core),),
        kw.pop("state", InstanceState.BOUND),  # type: ignore[arg-type]
        True,
    )


MEM, CORE = "cgpu.io/resize-gpu-mem", "cgpu.io/resize-gpu-core"


def test_a_pod_without_the_annotations_asks_nothing() -> None:
    assert asked(pod()) is None
    assert pod_resizes([pod()], [instance()], 1) == ([], [])


def test_the_annotations_read_in_the_units_of_the_resources() -> None:
    assert asked(pod(**{MEM: "6", CORE: " 50 "})) == Asked(6 * GIB, 50)
    assert asked(pod(**{CORE: "0"})) == Asked(None, 0)


def test_a_shrink_is_done_for_a_pod_of_any_priority_on_every_container_it_holds() -> None:
    p = pod(priority=-10, **{MEM: "2", CORE: "20"})
    held = [instance(container="main"), instance(container="side"), instance("u2")]
    resizes, refusals = pod_resizes([p, pod("u2")], held, 1)
    assert refusals == []
    assert [(r.instance.id, r.container, r.asked) for r in resizes] == [
        ("cgpu-u1-main", "main", Asked(2 * GIB, 20)),
        ("cgpu-u1-side", "side", Asked(2 * GIB, 20)),
    ]


def test_a_grow_needs_the_pods_priority_and_the_refusal_says_which() -> None:
    for asks in ({MEM: "8"}, {CORE: "40"}, {MEM: "2", CORE: "40"}):
        resizes, refusals = pod_resizes([pod(priority=0, **asks)], [instance()], 1)
        assert resizes == [] and len(refusals) == 1, asks
        assert "priority (0) is below this node's pod_share_priority_min (1)" in refusals[0].message
    resizes, refusals = pod_resizes([pod(priority=1, **{MEM: "8"})], [instance()], 1)
    assert refusals == [] and resizes[0].asked == Asked(8 * GIB, None)


def test_what_already_holds_and_what_is_not_a_running_pod_instance_are_left_alone() -> None:
    same = pod(**{MEM: "4", CORE: "30"})
    released = instance(state=InstanceState.RELEASED)
    other_kind = Instance(
        "cgpu-x", Owner(OwnerKind.PROCESS, "u1"), (Grant(0, "GPU-0", GIB, 0),), InstanceState.BOUND, True
    )
    assert pod_resizes([same], [instance()], 1) == ([], [])
    assert pod_resizes([pod(**{MEM: "2"})], [released, other_kind], 1) == ([], [])
    assert pod_resizes([pod("gone", **{MEM: "2"})], [instance()], 1) == ([], [])


def test_an_unreadable_annotation_is_refused_with_what_to_write() -> None:
    for value, message in (("4Gi", "is not a whole number GiB per GPU: set it to e.g. 4"), ("0", "use 1 to")):
        resizes, refusals = pod_resizes([pod(**{MEM: value})], [instance()], 1)
        assert resizes == [] and refusals[0].message.startswith("pod ns/pod-u1: cgpu.io/resize-gpu-mem="), value
        assert message in refusals[0].message
    _, refusals = pod_resizes([pod(**{CORE: "101"})], [instance()], 1)
    assert "cgpu.io/resize-gpu-core=101 is out of range: use 0 to 100 percent" in refusals[0].message
