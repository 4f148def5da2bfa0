"""bind.py with a fake node and a fake API server: reserve, bind with the annotations,
and give back on any failure after the Reserve."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from cgpud.node.model import Share
from cgpud.extender.bind import BindArgs, BindConflict, BindError, Binder
from cgpud.extender.client import CapacityError
from cgpud.extender.fit import Placement, Reason, fit
from cgpud.extender.pod import pod_demand
from cgpud.extender.state import ClusterState
from tests.harness.extender_nodes import GIB, container, gpu, node, pod


class FakeNode:
    def __init__(self) -> None:
        self.reserved: dict[str, tuple[Share, ...]] = {}
        self.refuse = ""
        self.code = grpc.StatusCode.RESOURCE_EXHAUSTED
        self.lose_answer = False
        self.revision = 7

    def reserve(self, uid: str, namespace: str, name: str, shares: Sequence[Share], ttl: int = 0) -> Any:
        if self.refuse:
            raise CapacityError(self.refuse, self.code)
        if self.lose_answer:  # held on the node, the answer never came back
            self.reserved[uid] = tuple(shares)
            raise CapacityError(
                "Reserve at 10.0.0.1:9455: DEADLINE_EXCEEDED: Deadline Exceeded", grpc.StatusCode.DEADLINE_EXCEEDED
            )
        self.reserved[uid] = tuple(shares)
        self.revision += 1
        return SimpleNamespace(pod_uid=uid, incarnation="inc-1", revision=self.revision, expires_unix_ms=9e15)

    def unreserve(self, uid: str) -> Any:
        return SimpleNamespace(released=self.reserved.pop(uid, None) is not None)


class FakeClients:
    def __init__(self) -> None:
        self.node = FakeNode()
        self.addresses: list[str] = []

    def get(self, node: str, address: str) -> FakeNode:
        self.addresses.append(address)
        return self.node


class FakeApi:
    def __init__(self, pods: Mapping[str, dict[str, Any]] = {}) -> None:
        self.pods = dict(pods)
        self.notes: dict[str, dict[str, str]] = {}
        self.bound: dict[str, str] = {}
        self.preconditions: dict[str, str] = {}  # the resourceVersion each Binding named
        self.gets = 0
        self.fail_bind = ""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        self.gets += 1
        if name not in self.pods:
            raise BindError(f"cannot read pod {namespace}/{name}: 404")
        return self.pods[name]

    def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str], resource_version: str = ""
    ) -> None:
        if self.fail_bind:
            raise BindError(self.fail_bind)
        stored = self.pods.get(name)
        if stored is not None and resource_version and stored["metadata"].get("resourceVersion") != resource_version:
            raise BindConflict(
                f'cannot bind pod {namespace}/{name}: 409 Operation cannot be fulfilled on pods "{name}"'
            )
        self.notes[name] = dict(annotations)
        self.bound[name] = node
        if stored is not None:
            stored["spec"]["nodeName"] = node
        self.preconditions[name] = resource_version


@pytest.fixture
def state() -> ClusterState:
    s = ClusterState()
    s.set_state("n1", "10.0.0.1:9455", node("n1", gpus=[gpu(0, used=8), gpu(1)], revision=7))
    s.set_down("n2", "10.0.0.2:9455", "connection refused")
    return s


def test_standalone_bind_reserves_holds_and_reports(state: ClusterState) -> None:
    clients = FakeClients()
    b = Binder(state, clients, None, clock=lambda: 5.0)  # type: ignore[arg-type]
    b.remember(pod_demand(pod("p", [container("c", mem="4")], uid="u1")))
    a = b.bind(BindArgs("p", "default", "u1", "n1"))
    assert a.gpus == (0,) and not a.bound and clients.addresses == ["10.0.0.1:9455"]
    assert clients.node.reserved == {"u1": (Share(0, 4 * GIB, 0, 1),)}
    assert a.annotations["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert a.annotations["ALIYUN_COM_GPU_MEM_ASSUME_TIME"] == str(5 * 10**9)
    rec = state.record("n1")
    assert rec is not None and rec.entry.state is not None
    assert rec.entry.state.gpus[0].memory_allocated == 12 * GIB  # the hold counts until the view does
    assert b.recent()[0]["pod"] == "default/p"


def test_bind_with_api_binds_with_the_annotations(state: ClusterState) -> None:
    api = FakeApi({"p": pod("p", [container("c", mem="8", count="2")], uid="u1")})
    b = Binder(state, FakeClients(), api)  # type: ignore[arg-type]
    a = b.bind(BindArgs("p", "default", "u1", "n1"))
    assert a.bound and api.bound == {"p": "n1"}
    assert api.notes["p"]["ALIYUN_COM_GPU_MEM_IDX"] == "0,1"
    assert api.notes["p"]["scheduler.framework.gpushare.allocation"] == '{"0":{"0":4,"1":4}}'


def test_bind_reads_a_pod_it_did_not_see_from_the_api(state: ClusterState) -> None:
    api = FakeApi({"p": pod("p", [container("c", mem="2")], uid="u9")})
    clients = FakeClients()
    b = Binder(state, clients, api)  # type: ignore[arg-type]
    b.bind(BindArgs("p", "default", "u9", "n1"))
    assert "u9" in clients.node.reserved and api.bound == {"p": "n1"}
    with pytest.raises(BindError, match="recreated"):
        b.bind(BindArgs("p", "default", "other-uid", "n1"))


def test_standalone_bind_of_an_unseen_pod_is_an_error(state: ClusterState) -> None:
    b = Binder(state, FakeClients(), None)  # type: ignore[arg-type]
    with pytest.raises(BindError, match="was not seen at filter or prioritize and there is no API server"):
        b.bind(BindArgs("p", "default", "u1", "n1"))


def test_a_failed_binding_gives_the_reservation_back(state: ClusterState) -> None:
    api = FakeApi({"p": pod("p", uid="u1")})
    api.fail_bind = "cannot bind pod default/p to node n1: 409 already bound"
    clients = FakeClients()
    b = Binder(state, clients, api)  # type: ignore[arg-type]
    with pytest.raises(BindError, match="409 already bound"):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert clients.node.reserved == {}
    rec = state.record("n1")
    assert rec is not None and rec.holds == ()


def test_a_refused_reserve_is_the_bind_error(state: ClusterState) -> None:
    clients = FakeClients()
    clients.node.refuse = "Reserve at 10.0.0.1:9455: RESOURCE_EXHAUSTED: no GPU has 4 GiB free"
    b = Binder(state, clients, FakeApi({"p": pod("p", uid="u1")}))  # type: ignore[arg-type]
    with pytest.raises(BindError, match="node n1 did not reserve for pod default/p: .*RESOURCE_EXHAUSTED"):
        b.bind(BindArgs("p", "default", "u1", "n1"))


@pytest.mark.parametrize(
    "target, words",
    [
        ("n2", "Capacity stream is down \\(connection refused\\): not binding there"),
        ("n9", "unknown to cgpu-scheduler"),
    ],
)
def test_down_or_unknown_node_is_never_guessed(state: ClusterState, target: str, words: str) -> None:
    clients = FakeClients()
    b = Binder(state, clients, FakeApi({"p": pod("p", uid="u1")}))  # type: ignore[arg-type]
    with pytest.raises(BindError, match=words):
        b.bind(BindArgs("p", "default", "u1", target))
    assert clients.node.reserved == {}


def test_a_pod_that_no_longer_fits_is_not_reserved(state: ClusterState) -> None:
    clients = FakeClients()
    b = Binder(state, clients, FakeApi({"p": pod("p", [container("c", mem="18", count="2")], uid="u1")}))  # type: ignore[arg-type]
    with pytest.raises(BindError, match="no longer fits node n1"):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert clients.node.reserved == {}


def test_a_pod_without_gpu_share_is_refused_not_bound(state: ClusterState) -> None:
    """The attack: /bind of any pending pod that asks for no GPU (a database
    in another namespace) to any node name, even one cgpu does not know."""
    api = FakeApi({"payments-db-0": pod("payments-db-0", [container("c")], uid="u1", namespace="prod")})
    clients = FakeClients()
    b = Binder(state, clients, api)  # type: ignore[arg-type]
    for name in ("control-plane-1", "n1"):
        with pytest.raises(BindError, match="asks for no GPU share .*binds only pods it places"):
            b.bind(BindArgs("payments-db-0", "prod", "u1", name))
    assert api.bound == {} and clients.addresses == []


def test_bind_places_the_pod_the_api_server_has_not_the_one_filter_was_sent(state: ClusterState) -> None:
    """A caller that sent /filter a 1 GiB pod under the uid of a 36 GiB one
    (or no pod at all) gets the real pod judged: it does not fit n1."""
    api = FakeApi({"p": pod("p", [container("c", mem="36", count="2")], uid="u1")})
    clients = FakeClients()
    b = Binder(state, clients, api)  # type: ignore[arg-type]
    b.remember(pod_demand(pod("p", [container("c", mem="1")], uid="u1")))
    with pytest.raises(BindError, match="no longer fits node n1"):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert clients.node.reserved == {} and api.bound == {}


def test_a_pod_already_bound_is_not_bound_again(state: ClusterState) -> None:
    bound = pod("p", uid="u1")
    bound["spec"]["nodeName"] = "n7"
    clients = FakeClients()
    b = Binder(state, clients, FakeApi({"p": bound}))  # type: ignore[arg-type]
    with pytest.raises(BindError, match="already bound to node n7"):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert clients.node.reserved == {}


def test_a_reserve_whose_answer_was_lost_is_given_back(state: ClusterState) -> None:
    clients = FakeClients()
    clients.node.lose_answer = True
    b = Binder(state, clients, FakeApi({"p": pod("p", uid="u1")}))  # type: ignore[arg-type]
    with pytest.raises(BindError, match="DEADLINE_EXCEEDED"):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert clients.node.reserved == {}


def test_the_hold_counts_while_the_reserve_is_under_way(state: ClusterState) -> None:
    clients = FakeClients()
    seen: list[int] = []
    real = clients.node.reserve

    def reserve(*a: Any, **k: Any) -> Any:
        rec = state.record("n1")
        assert rec is not None and rec.entry.state is not None
        seen.append(rec.entry.state.gpus[0].memory_allocated)
        return real(*a, **k)

    clients.node.reserve = reserve  # type: ignore[method-assign]
    b = Binder(state, clients, None)  # type: ignore[arg-type]
    b.remember(pod_demand(pod("p", [container("c", mem="4")], uid="u1")))
    b.bind(BindArgs("p", "default", "u1", "n1"))
    assert seen == [12 * GIB]  # 8 GiB the view had, 4 GiB pending
    rec = state.record("n1")
    assert rec is not None and [(h.pod_uid, h.incarnation) for h in rec.holds] == [("u1", "inc-1")]


def test_a_refused_reserve_drops_its_pending_hold(state: ClusterState) -> None:
    clients = FakeClients()
    clients.node.refuse = "RESOURCE_EXHAUSTED: no"
    b = Binder(state, clients, None)  # type: ignore[arg-type]
    b.remember(pod_demand(pod("p", uid="u1")))
    with pytest.raises(BindError):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    rec = state.record("n1")
    assert rec is not None and rec.holds == ()


def test_a_whole_gpu_pod_is_not_bound_here(state: ClusterState) -> None:
    """Whole GPUs are filtered and scored, then bound by kube-scheduler (no
    bindVerb on that extender entry): nothing to reserve or annotate."""
    spec = {"name": "c", "image": "x", "resources": {"limits": {"aliyun.com/gpu": 2}}}
    api = FakeApi({"t": pod("t", [spec], uid="u1")})
    clients = FakeClients()
    b = Binder(state, clients, api)  # type: ignore[arg-type]
    with pytest.raises(BindError, match=r"asks for whole GPUs \(aliyun.com/gpu\).*does not bind"):
        b.bind(BindArgs("t", "default", "u1", "n1"))
    assert clients.node.reserved == {} and api.bound == {}


def _versioned(p: dict[str, Any], version: str) -> dict[str, Any]:
    p["metadata"]["resourceVersion"] = version
    return p


def test_verified_callers_bind_from_the_pod_seen_at_filter_under_its_resource_version(state: ClusterState) -> None:
    api = FakeApi()  # a GET would fail: the pod is not there
    clients = FakeClients()
    b = Binder(state, clients, api, callers_verified=True)  # type: ignore[arg-type]
    b.remember(pod_demand(_versioned(pod("p", [container("c", mem="4")], uid="u1"), "41")))
    a = b.bind(BindArgs("p", "default", "u1", "n1"))
    assert a.bound and api.bound == {"p": "n1"} and api.gets == 0
    assert api.preconditions == {"p": "41"}
    assert clients.node.reserved == {"u1": (Share(0, 4 * GIB, 0, 1),)}


def test_unverified_callers_bind_from_the_api_servers_copy(state: ClusterState) -> None:
    """Anyone may call /filter without a client CA: what it sent is not the
    pod, the API server's copy is (its version the Binding's precondition)."""
    api = FakeApi({"p": _versioned(pod("p", [container("c", mem="8")], uid="u1"), "7")})
    clients = FakeClients()
    b = Binder(state, clients, api)  # type: ignore[arg-type]
    b.remember(pod_demand(_versioned(pod("p", [container("c", mem="1")], uid="u1"), "7")))
    b.bind(BindArgs("p", "default", "u1", "n1"))
    assert api.gets == 1 and api.preconditions == {"p": "7"}
    assert clients.node.reserved["u1"][0].memory == 8 * GIB  # as the API server has it


@pytest.mark.parametrize(
    "seen",
    [
        pod("p", [container("c", mem="1")], uid="u1"),  # no resourceVersion: nothing to hold the Binding to
        _versioned(pod("other", [container("c", mem="1")], uid="u1"), "3"),  # another pod's name under the UID
        _versioned(pod("p", [container("c", mem="1")], uid="u2"), "3"),  # another UID
    ],
    ids=["no resourceVersion", "other name", "other uid"],
)
def test_verified_callers_bind_from_the_api_unless_filter_saw_this_very_pod_with_a_version(
    state: ClusterState, seen: dict[str, Any]
) -> None:
    api = FakeApi({"p": _versioned(pod("p", [container("c", mem="8")], uid="u1"), "9")})
    clients = FakeClients()
    b = Binder(state, clients, api, callers_verified=True)  # type: ignore[arg-type]
    b.remember(pod_demand(seen))
    b.bind(BindArgs("p", "default", "u1", "n1"))
    assert api.gets == 1 and api.preconditions == {"p": "9"}
    assert clients.node.reserved["u1"][0].memory == 8 * GIB


def test_a_pod_written_since_its_filter_with_the_same_gpu_request_is_bound_under_its_new_version(
    state: ClusterState,
) -> None:
    """kube-scheduler writes nominatedNodeName before a PreBind with work
    (v1.35+): its copy is then one version behind. Read once, bound."""
    now = _versioned(pod("p", [container("c", mem="4")], uid="u1"), "42")
    now["metadata"]["labels"] = {"team": "b"}
    api = FakeApi({"p": now})
    clients = FakeClients()
    b = Binder(state, clients, api, callers_verified=True)  # type: ignore[arg-type]
    b.remember(pod_demand(_versioned(pod("p", [container("c", mem="4")], uid="u1"), "41")))
    a = b.bind(BindArgs("p", "default", "u1", "n1"))
    assert a.bound and api.bound == {"p": "n1"} and api.gets == 1 and api.preconditions == {"p": "42"}
    assert clients.node.reserved == {"u1": (Share(0, 4 * GIB, 0, 1),)}


@pytest.mark.parametrize(
    ("now", "error"),
    [
        (_versioned(pod("p", [container("c", mem="8")], uid="u1"), "42"), "changed its GPU request"),
        (
            dict(_versioned(pod("p", [container("c", mem="4")], uid="u1"), "42"), spec={"nodeName": "n9"}),
            "already bound",
        ),
        (_versioned(pod("p", [container("c", mem="4")], uid="u2"), "42"), "it was recreated"),
    ],
    ids=["request changed", "bound elsewhere", "recreated"],
)
def test_a_pod_changed_since_its_filter_in_what_the_bind_depends_on_is_refused_and_nothing_held(
    state: ClusterState, now: dict[str, Any], error: str
) -> None:
    api = FakeApi({"p": now})
    clients = FakeClients()
    b = Binder(state, clients, api, callers_verified=True)  # type: ignore[arg-type]
    b.remember(pod_demand(_versioned(pod("p", [container("c", mem="4")], uid="u1"), "41")))
    with pytest.raises(BindError, match=error):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert api.bound == {} and clients.node.reserved == {}
    rec = state.record("n1")
    assert rec is not None and rec.holds == ()


def test_a_second_bind_of_a_pod_it_bound_reads_the_pod_and_keeps_the_first_reservation(state: ClusterState) -> None:
    """kube-scheduler lost the first answer and filters the pod again from
    a copy its informer has not yet seen bound: the second bind must not
    Reserve again, which would replace (and then give back) the first."""
    api = FakeApi({"p": _versioned(pod("p", [container("c", mem="4")], uid="u1"), "41")})
    clients = FakeClients()
    b = Binder(state, clients, api, callers_verified=True)  # type: ignore[arg-type]
    b.remember(pod_demand(_versioned(pod("p", [container("c", mem="4")], uid="u1"), "41")))
    b.bind(BindArgs("p", "default", "u1", "n1"))
    first = dict(clients.node.reserved)
    b.remember(pod_demand(_versioned(pod("p", [container("c", mem="4")], uid="u1"), "41")))
    with pytest.raises(BindError, match="already bound to node n1"):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert api.gets == 1 and clients.node.reserved == first == {"u1": (Share(0, 4 * GIB, 0, 1),)}


# ---- the filter's pick (--pick-at-filter) -------------------------------------------------


def _picked(b: Binder, state: ClusterState, p: dict[str, Any], where: str) -> None:
    """The filter picking `where` for `p`, as server.Extender does."""
    demand = pod_demand(p)
    b.remember(demand)
    rec = state.record(where)
    assert rec is not None and rec.summary is not None
    placement = fit(demand, rec.summary)
    assert isinstance(placement, Placement), placement
    b.picked(demand, where, placement)


def _allocated(state: ClusterState, name: str) -> int:
    """Memory the node's view counts taken, holds included, over its GPUs."""
    rec = state.record(name)
    assert rec is not None and rec.entry.state is not None
    return sum(g.memory_allocated for g in rec.entry.state.gpus)


def test_a_pick_is_held_for_the_next_filter_and_its_bind_places_it_once(state: ClusterState) -> None:
    state.set_state("n1", "10.0.0.1:9455", node("n1", gpus=[gpu(0, used=8), gpu(1, used=16)], revision=7))
    clients = FakeClients()
    b = Binder(state, clients, FakeApi(), callers_verified=True)  # type: ignore[arg-type]
    _picked(b, state, _versioned(pod("p", [container("c", mem="8")], uid="u1"), "41"), "n1")
    # The next pod's filter counts the pick: the last 8 GiB are taken.
    assert _allocated(state, "n1") == 32 * GIB
    rec = state.record("n1")
    assert rec is not None and rec.summary is not None
    other = fit(pod_demand(pod("q", [container("c", mem="8")], uid="u2")), rec.summary)
    assert isinstance(other, Reason) and "no GPU has 8 GiB free" in other.text
    # Its own bind is placed by the pick, not refused for it.
    a = b.bind(BindArgs("p", "default", "u1", "n1"))
    assert a.gpus == (0,) and clients.node.reserved == {"u1": (Share(0, 8 * GIB, 0, 1),)}
    assert _allocated(state, "n1") == 32 * GIB  # counted once


def test_a_pod_picked_again_elsewhere_gives_its_first_pick_back(state: ClusterState) -> None:
    state.set_state("n3", "10.0.0.3:9455", node("n3", gpus=[gpu(0), gpu(1)], revision=1))
    b = Binder(state, FakeClients(), FakeApi(), callers_verified=True)  # type: ignore[arg-type]
    p = _versioned(pod("p", [container("c", mem="4")], uid="u1"), "41")
    _picked(b, state, p, "n1")
    assert _allocated(state, "n1") == 12 * GIB
    _picked(b, state, p, "n3")
    assert _allocated(state, "n1") == 8 * GIB and _allocated(state, "n3") == 4 * GIB


def test_a_refused_bind_gives_its_pick_back(state: ClusterState) -> None:
    clients = FakeClients()
    clients.node.refuse = "RESOURCE_EXHAUSTED: no GPU has 4 GiB free"
    b = Binder(state, clients, FakeApi(), callers_verified=True)  # type: ignore[arg-type]
    _picked(b, state, _versioned(pod("p", [container("c", mem="4")], uid="u1"), "41"), "n1")
    assert _allocated(state, "n1") == 12 * GIB
    with pytest.raises(BindError, match="did not reserve"):
        b.bind(BindArgs("p", "default", "u1", "n1"))
    assert _allocated(state, "n1") == 8 * GIB


def test_picks_from_callers_anyone_may_be_hold_nothing(state: ClusterState) -> None:
    """Without kube-scheduler's client certificate a filter is anyone's: a
    pick held for it would let anyone make every node look full."""
    b = Binder(state, FakeClients(), FakeApi())  # type: ignore[arg-type]
    _picked(b, state, pod("p", [container("c", mem="4")], uid="u1"), "n1")
    assert _allocated(state, "n1") == 8 * GIB


def test_at_most_picks_are_held_however_many_pods_are_filtered(
    state: ClusterState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller filtering pod after pod that never binds holds no more than
    the picks remembered: the oldest is given back."""
    monkeypatch.setattr("cgpud.extender.bind.PICKS", 3)
    b = Binder(state, FakeClients(), FakeApi(), callers_verified=True)  # type: ignore[arg-type]
    for k in range(6):
        _picked(b, state, _versioned(pod(f"p{k}", [container("c", mem="1")], uid=f"u{k}"), "1"), "n1")
    rec = state.record("n1")
    assert rec is not None and [h.pod_uid for h in rec.holds] == ["u3", "u4", "u5"]
    assert _allocated(state, "n1") == 11 * GIB
