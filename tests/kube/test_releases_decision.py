"""Which pod instances go (cgpud/kube/releases.py gone_instances): only
when the API server and the kubelet agree the pod is gone, never one a
running container holds."""

from __future__ import annotations

from cgpud.node.model import Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.kube.apiserver import PodInfo
from cgpud.kube.releases import KubeletPod, gone_instances


def instance(
    iid: str, owner: str, state: InstanceState = InstanceState.RESERVED, kind: OwnerKind = OwnerKind.POD
) -> Instance:
    return Instance(iid, Owner(kind, owner), (Grant(0, "GPU-a", 1 << 30, 0),), state, True)


def api_pod(uid: str, name: str, phase: str = "Running") -> PodInfo:
    return PodInfo(uid, "ns", name, "node-1", phase)


def ids(found: list[Instance]) -> list[str]:
    return [i.id for i in found]


def test_released_only_when_both_witnesses_say_gone():
    inst = instance("i1", "u1/ns/p1/main")
    assert ids(gone_instances([inst], [], [])) == ["i1"]
    # The API server has it: alive.
    assert gone_instances([inst], [api_pod("u1", "p1")], []) == []
    # The API server lost it but the kubelet still runs it: wait.
    assert gone_instances([inst], [], [KubeletPod("ns", "p1")]) == []


def test_a_finished_pod_goes_even_while_the_kubelet_still_lists_it():
    inst = instance("i1", "u1/ns/p1/main")
    for phase in ("Succeeded", "Failed"):
        assert ids(gone_instances([inst], [api_pod("u1", "p1", phase)], [KubeletPod("ns", "p1")])) == ["i1"]
    assert gone_instances([inst], [api_pod("u1", "p1", "Pending")], [KubeletPod("ns", "p1")]) == []


def test_a_pod_recreated_under_the_same_name_does_not_keep_the_old_instance():
    old = instance("i1", "u1/ns/web-0/main")
    new = instance("i2", "u2/ns/web-0/main")
    found = gone_instances([old, new], [api_pod("u2", "web-0")], [KubeletPod("ns", "web-0")])
    assert ids(found) == ["i1"]


def test_bound_foreign_and_other_owners_are_left_alone():
    held = instance("i1", "u1/ns/p1/main", InstanceState.BOUND)
    odd = instance("i2", "not-ours")
    device = instance("i3", "u3/ns/p3/main", kind=OwnerKind.DEVICE)
    released = instance("i4", "u4/ns/p4/main", InstanceState.RELEASED)
    assert gone_instances([held, odd, device, released], [], []) == []


def test_a_reservation_goes_when_its_pod_finished_or_has_been_missing_for_the_grace():
    from cgpud.node.model import Reservation, Share
    from cgpud.kube.releases import gone_reservations

    def res(uid: str) -> Reservation:
        return Reservation(uid, "ns", uid, (Share(0, 1 << 30),), expires=1e12)

    def on_node(uid: str, phase: str = "Running", deleting: bool = False) -> PodInfo:
        return PodInfo(uid, "ns", uid, "node-1", phase, deleting=deleting)

    held = [res("live"), res("done"), res("dying"), res("new"), res("old")]
    pods = [on_node("live"), on_node("done", "Failed"), on_node("dying", deleting=True)]
    gone, missing = gone_reservations(held, pods, {"old": 10.0}, now=15.0, grace=5.0)
    assert [r.pod_uid for r in gone] == ["done", "dying", "old"]
    assert missing == {"new": 15.0}  # first seen missing now; the live one is not missing
    gone, missing = gone_reservations([res("new")], [], missing, now=19.9, grace=5.0)
    assert gone == [] and missing == {"new": 15.0}
    gone, missing = gone_reservations([res("new")], [on_node("new")], missing, now=19.9, grace=5.0)
    assert gone == [] and missing == {}  # bound in time: forgotten
