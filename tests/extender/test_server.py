"""server.py over real sockets: the extender v1 JSON as kube-scheduler sends it."""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from cgpud.extender.bind import Assignment, BindArgs, BindError
from cgpud.extender.fit import Placement, Reason, Rendered, render
from cgpud.extender.model import view_from_json
from cgpud.extender.pod import PodDemand
from cgpud.extender.server import MAX_BODY, ExtenderServer, _Judged
from cgpud.extender.state import ClusterState
from tests.harness.extender_nodes import container, gpu, node, pod


class FakeBinder:
    def __init__(self) -> None:
        self.seen: list[PodDemand] = []
        self.bound: list[BindArgs] = []
        self.fail = ""
        self.picks: list[tuple[str, str]] = []

    def remember(self, demand: PodDemand) -> None:
        self.seen.append(demand)

    def picked(self, demand: PodDemand, node: str, placement: Placement) -> None:
        self.picks.append((demand.name, node))

    def bind(self, args: BindArgs) -> Assignment:
        if self.fail:
            raise BindError(self.fail)
        self.bound.append(args)
        return Assignment(f"{args.pod_namespace}/{args.pod_name}", args.pod_uid, args.node, (0,), {}, False, 0.0)

    def recent(self) -> list[dict[str, Any]]:
        return [{"pod": b.pod_name} for b in self.bound]


@pytest.fixture
def cluster() -> ClusterState:
    s = ClusterState()
    s.set_state("busy", "10.0.0.1:9455", node("busy", gpus=[gpu(0, used=10), gpu(1, used=14)]))
    s.set_state("idle", "10.0.0.2:9455", node("idle", gpus=[gpu(0), gpu(1)]))
    s.set_state("whole", "10.0.0.3:9455", node("whole", mode="default"))
    s.set_down("dead", "10.0.0.4:9455", "connection refused")
    return s


@pytest.fixture
def server(cluster: ClusterState) -> Iterator[tuple[ExtenderServer, FakeBinder]]:
    binder = FakeBinder()
    srv = ExtenderServer(cluster, binder, "127.0.0.1", 0).start()
    yield srv, binder
    srv.stop()


class Conn:
    """One keep-alive connection, as kube-scheduler keeps one."""

    def __init__(self, port: int) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)

    def call(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        self.c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = self.c.getresponse()
        return r.status, json.loads(r.read())


def args(p: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"Pod": p, "Nodes": None, "NodeNames": names}


ALL = ["busy", "idle", "whole", "dead", "ghost"]


def test_filter_with_node_names(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, binder = server
    code, out = Conn(srv.port).call("POST", "/filter", args(pod(containers=[container("c", mem="4")]), ALL))
    assert code == 200
    assert out["NodeNames"] == ["busy", "idle"] and out["Nodes"] is None and out["Error"] == ""
    unres = out["FailedAndUnresolvableNodes"]
    assert set(unres) == {"whole", "dead", "ghost"}
    assert "node mode default gives whole GPUs" in unres["whole"]
    assert "Capacity stream is down (connection refused)" in unres["dead"]
    assert "unknown to cgpu-scheduler" in unres["ghost"]
    assert out["FailedNodes"] == {}
    assert [d.name for d in binder.seen] == ["p"]


@pytest.mark.parametrize("names", [["dead"], ["whole", "dead"], ["ghost", "dead"]])
def test_filter_answers_an_error_when_no_node_fits_and_one_is_only_unreachable_for_now(
    server: tuple[ExtenderServer, FakeBinder], names: list[str]
) -> None:
    """kube-scheduler parks a pod its extender filtered out until a cluster
    event; a cgpud coming back is none. An error is retried within 10 s."""
    srv, _ = server
    code, out = Conn(srv.port).call("POST", "/filter", args(pod(containers=[container("c", mem="4")]), names))
    assert code == 200
    assert "dead: cgpud's Capacity stream is down (connection refused)" in out["Error"], out
    assert "kube-scheduler retries it" in out["Error"]
    assert not out.get("NodeNames") and not out.get("FailedNodes")


def test_filter_without_a_node_down_refuses_as_usual(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    _, out = Conn(srv.port).call("POST", "/filter", args(pod(containers=[container("c", mem="4")]), ["whole", "ghost"]))
    assert (
        out["Error"] == "" and out["NodeNames"] == [] and set(out["FailedAndUnresolvableNodes"]) == {"whole", "ghost"}
    )


def test_filter_resolvable_capacity_shortfall(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    _, out = Conn(srv.port).call("POST", "/filter", args(pod(containers=[container("c", mem="8")]), ["busy", "idle"]))
    assert out["NodeNames"] == ["idle"]
    assert "no GPU has 8 GiB free" in out["FailedNodes"]["busy"]


def test_filter_with_full_node_objects(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    items = [{"metadata": {"name": n, "labels": {"x": n}}, "status": {}} for n in ("busy", "whole")]
    body = {"Pod": pod(), "Nodes": {"metadata": {}, "items": items}, "NodeNames": None}
    code, out = Conn(srv.port).call("POST", "/filter", body)
    assert code == 200 and out["NodeNames"] is None
    assert out["Nodes"]["items"] == [items[0]] and "whole" in out["FailedAndUnresolvableNodes"]


def test_filter_pod_without_gpu_share_passes_every_node(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    _, out = Conn(srv.port).call("POST", "/filter", args(pod(containers=[container("c")]), ALL))
    assert out["NodeNames"] == ALL and out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"] == {}


def test_filter_bad_pod_resources_fail_every_node_with_the_reason(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    _, out = Conn(srv.port).call("POST", "/filter", args(pod(containers=[container("c", mem="2", core="7")]), ALL))
    assert out["NodeNames"] == []
    assert set(out["FailedAndUnresolvableNodes"]) == set(ALL)
    assert "multiple of 5" in out["FailedAndUnresolvableNodes"]["idle"]


def test_prioritize_binpack_prefers_the_fuller_node(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    code, out = Conn(srv.port).call("POST", "/prioritize", args(pod(), ["busy", "idle", "whole", "ghost"]))
    assert code == 200
    scores = {h["Host"]: h["Score"] for h in out}
    assert scores["busy"] > scores["idle"] > 0 and scores["whole"] == 0 and scores["ghost"] == 0
    assert all(0 <= s <= 10 for s in scores.values())


def test_bind_calls_the_binder_and_reports_its_error(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, binder = server
    c = Conn(srv.port)
    body = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "idle"}
    assert c.call("POST", "/bind", body) == (200, {"Error": ""})
    assert binder.bound == [BindArgs("p", "ns", "u", "idle")]
    binder.fail = "node idle did not reserve: RESOURCE_EXHAUSTED"
    assert c.call("POST", "/bind", body) == (200, {"Error": "node idle did not reserve: RESOURCE_EXHAUSTED"})


def test_healthz_and_inspect(server: tuple[ExtenderServer, FakeBinder], cluster: ClusterState) -> None:
    srv, _ = server
    c = Conn(srv.port)
    assert c.call("GET", "/healthz") == (200, {"status": "ok"})
    code, out = c.call("GET", "/inspect")
    assert code == 200 and view_from_json(out) == cluster.view()
    assert "recent_binds" in out and out["pick_at_filter"] is False
    # Requests answered per verb; a refused one is not counted.
    assert out["requests"] == {"filter": 0, "prioritize": 0, "bind": 0}
    c.call("POST", "/filter", args(pod(), ["idle"]))
    c.call("POST", "/prioritize", args(pod(), ["idle"]))
    c.call("POST", "/prioritize", raw=b"{not json")
    assert c.call("GET", "/inspect")[1]["requests"] == {"filter": 1, "prioritize": 1, "bind": 0}


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/filter", b"{not json", "the body is not JSON"),
        ("/filter", b"[1]", "ExtenderArgs must be a JSON object, not a list"),
        ("/filter", b'{"NodeNames": ["a"]}', "ExtenderArgs has no Pod"),
        ("/filter", b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}}', "neither NodeNames"),
        ("/filter", b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": "a"}', "list of node names"),
        (
            "/filter",
            b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "Nodes": {"items": [{}]}}',
            r"Nodes.items\[0\] has no metadata.name",
        ),
        ("/prioritize", b'{"Pod": 3, "NodeNames": []}', "ExtenderArgs.Pod: Pod is int"),
        # A small body must not ask for a huge answer (each unknown node gets its reason).
        (
            "/filter",
            json.dumps({"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": ["x"] * 20_001}).encode(),
            "names 20001 nodes: cgpu-scheduler takes at most 20000",
        ),
        (
            "/prioritize",
            b'{"Pod": {"metadata": {"name": "p"}, "spec": {}}, "NodeNames": ["busy", "idle", "busy"]}',
            "names a node more than once",
        ),
        ("/bind", b'{"PodName": "p"}', "ExtenderBindingArgs has no Node"),
        ("/bind", b'{"PodName": 1, "Node": "n"}', "PodName must be a string"),
    ],
)
def test_malformed_requests_get_400_and_change_nothing(
    server: tuple[ExtenderServer, FakeBinder], path: str, body: bytes, words: str
) -> None:
    srv, binder = server
    c = Conn(srv.port)
    code, out = c.call("POST", path, raw=body)
    assert code == 400 and set(out) == {"Error"}
    import re

    assert re.search(words, out["Error"]), out
    assert binder.bound == [] and binder.seen == []
    # The connection is still good for the next request.
    assert c.call("GET", "/healthz")[0] == 200


def test_unknown_paths_and_oversized_bodies(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    code, out = Conn(srv.port).call("POST", "/schedule", {})
    assert code == 404 and "use /filter" in out["Error"]
    code, out = Conn(srv.port).call("GET", "/nope")
    assert code == 404
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    c.putrequest("POST", "/filter")
    c.putheader("Content-Length", str(MAX_BODY + 1))
    c.endheaders()
    r = c.getresponse()
    assert r.status == 413 and "at most" in json.loads(r.read())["Error"]


def test_many_requests_on_one_connection(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    c = Conn(srv.port)
    for _ in range(50):
        code, out = c.call("POST", "/filter", args(pod(), ["idle"]))
        assert code == 200 and out["NodeNames"] == ["idle"]


def test_a_new_view_is_answered_for_recent_pod_shapes_before_it_is_read(
    server: tuple[ExtenderServer, FakeBinder], cluster: ClusterState
) -> None:
    srv, _ = server
    c = Conn(srv.port)
    c.call("POST", "/filter", args(pod(containers=[container("c", mem="4")]), ["idle"]))
    c.call("POST", "/filter", args(pod(containers=[container("c", mem="6", count="2")]), ["idle"]))
    cluster.set_state("idle", "10.0.0.2:9455", node("idle", gpus=[gpu(0, used=2), gpu(1)], revision=2))
    rec = cluster.record("idle")
    assert rec is not None and rec.summary is not None
    shapes = set(rec.summary.rendered)
    assert shapes == {((4 << 30, 0, 1),), ((3 << 30, 0, 2),)}
    answer, text, *_ = rec.summary.rendered[((4 << 30, 0, 1),)]
    assert answer.containers == ((4 << 30, 0, (0,)),) and text == f'{{"Host":"idle","Score":{answer.score}}}'
    # And the HTTP answer is that one.
    _, out = c.call("POST", "/prioritize", args(pod(containers=[container("c", mem="4")]), ["idle"]))
    assert out == [{"Host": "idle", "Score": answer.score}]


def test_answers_kept_per_node_list_follow_every_change(
    server: tuple[ExtenderServer, FakeBinder], cluster: ClusterState
) -> None:
    srv, _ = server
    c = Conn(srv.port)
    names = ["busy", "idle", "ghost"]
    p = pod(containers=[container("c", mem="8")])
    for _ in range(2):  # kept from the second time
        _, out = c.call("POST", "/filter", args(p, names))
        assert out["NodeNames"] == ["idle"] and "busy" in out["FailedNodes"]
    assert len(srv.extender._memos) == 1
    kept = next(iter(srv.extender._memos.values()))
    # idle fills up, busy empties: the next pod of that shape sees both.
    cluster.set_state("idle", "10.0.0.2:9455", node("idle", gpus=[gpu(0, used=12), gpu(1, used=12)], revision=2))
    cluster.set_state("busy", "10.0.0.1:9455", node("busy", gpus=[gpu(0), gpu(1)], revision=2))
    _, out = c.call("POST", "/filter", args(pod("q", containers=[container("c", mem="8")]), names))
    assert out["NodeNames"] == ["busy"] and "no GPU has 8 GiB free" in out["FailedNodes"]["idle"]
    _, prio = c.call("POST", "/prioritize", args(p, names))
    assert [h["Host"] for h in prio] == names and prio[1]["Score"] == 0 and prio[0]["Score"] > 0
    memo = next(iter(srv.extender._memos.values()))
    assert memo is kept and memo.generation == cluster.generation  # patched, not rebuilt
    # A node going away, a node source's reason for one it skips.
    cluster.remove("busy")
    _, out = c.call("POST", "/filter", args(p, names))
    assert "unknown to cgpu-scheduler" in out["FailedAndUnresolvableNodes"]["busy"]
    srv.extender.skipped = {"ghost": "no cgpu.io/capacity-address annotation: not a cgpu node"}
    _, out = c.call("POST", "/filter", args(p, names))
    assert out["NodeNames"] == [] and "unknown to cgpu-scheduler" in out["FailedAndUnresolvableNodes"]["busy"]
    assert out["FailedAndUnresolvableNodes"]["ghost"] == "no cgpu.io/capacity-address annotation: not a cgpu node"


def test_reasons_name_the_container_of_the_pod_asked_about(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    c = Conn(srv.port)
    one = pod("one", [container("a", mem="2"), container("b", mem="30")])
    two = pod("two", [container("x", mem="2"), container("y", mem="30")])
    _, out1 = c.call("POST", "/filter", args(one, ["idle"]))
    _, out2 = c.call("POST", "/filter", args(two, ["idle"]))
    assert "container b " in out1["FailedAndUnresolvableNodes"]["idle"]
    assert "container y " in out2["FailedAndUnresolvableNodes"]["idle"]


def raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send `data` on a fresh connection, read until the server closes it."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while True:
            piece = s.recv(65536)
            if not piece:
                return got
            got += piece


def test_the_request_head_is_read_by_hand_with_http_servers_bounds(server: tuple[ExtenderServer, FakeBinder]) -> None:
    """The handler reads heads itself: what it does not take is refused
    with a JSON Error and the connection closed (the close ends raw_exchange)."""
    srv, binder = server
    body = json.dumps(args(pod(containers=[container("c", mem="4")]), ["idle"])).encode()
    chunked = raw_exchange(
        srv.port,
        b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
    )
    assert chunked.startswith(b"HTTP/1.1 411 ") and b"Connection: close" in chunked
    assert raw_exchange(srv.port, b"GET /healthz HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.1 505 ")
    assert raw_exchange(srv.port, b"GET /healthz\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    long_header = b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n"
    assert raw_exchange(srv.port, long_header).startswith(b"HTTP/1.1 431 ")
    many = b"GET /healthz HTTP/1.1\r\n" + b"X: 1\r\n" * 101 + b"\r\n"
    assert raw_exchange(srv.port, many).startswith(b"HTTP/1.1 431 ")
    two_lengths = b"POST /filter HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"
    assert raw_exchange(srv.port, two_lengths).startswith(b"HTTP/1.1 400 ")
    assert raw_exchange(srv.port, b"DELETE /filter HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 501 ")
    assert binder.seen == []


def test_keep_alive_pipelining_http_1_0_and_expect_100_continue(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, binder = server
    body = json.dumps(args(pod(containers=[container("c", mem="4")]), ["idle"])).encode()
    post = b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    # Two requests in one write, then one asking to close: three answers in order.
    got = raw_exchange(
        srv.port, post + b"GET /healthz HTTP/1.1\r\n\r\n" + b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
    )
    assert got.count(b"HTTP/1.1 200 OK") == 3 and got.index(b'"NodeNames":["idle"]') < got.index(b'"status"')
    # HTTP/1.0 without keep-alive: one answer, closed.
    got = raw_exchange(srv.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in got
    # Expect: 100-continue: the interim answer first, then the verb's.
    import socket

    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(body)
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"NodeNames":["idle"]' in answer
    assert [d.name for d in binder.seen] == ["p", "p"]


def test_a_node_list_sent_again_is_found_by_its_text(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, _ = server
    c = Conn(srv.port)
    names = ["busy", "idle", "ghost"]
    compact = json.dumps(args(pod(), names), separators=(",", ":")).encode()
    for _ in range(2):
        code, out = c.call("POST", "/filter", raw=compact)
        assert code == 200 and out["NodeNames"] == ["busy", "idle"]
    text = compact[compact.rindex(b"[") :][:-1]
    kept = srv.extender._texts[text]
    assert list(kept) == names
    body, texts = srv.extender.parse(compact)
    assert body["NodeNames"] is kept and texts is not None and texts.names == text
    # The same list's text behind a pod that is wrong is still a 400, and a
    # list that failed the checks is never kept.
    code, out = c.call("POST", "/filter", raw=b'{"Pod":3,"NodeNames":' + text + b"}")
    assert code == 400 and "ExtenderArgs.Pod" in out["Error"]
    twice = b'{"Pod":{"metadata":{"name":"p"},"spec":{}},"NodeNames":["busy","busy"]}'
    for _ in range(2):
        code, out = c.call("POST", "/filter", raw=twice)
        assert code == 400 and "more than once" in out["Error"]
    assert b'["busy","busy"]' not in srv.extender._texts
    # A body the cut would misread is parsed whole.
    code, out = c.call("POST", "/filter", raw=b'{,"NodeNames":' + text + b"}")
    assert code == 400 and "not JSON" in out["Error"]


def test_answers_joined_in_blocks_are_the_answers_joined_whole() -> None:
    from cgpud.extender.fit import Placement, Reason, render
    from cgpud.extender.server import BLOCK, FILTER, PRIORITIZE, _Judged

    def one(i: int, fits: bool) -> Any:
        name = json.dumps(f"n{i}")
        return render(Placement(f"n{i}", (), 0.5, False, i % 11) if fits else Reason(f"full {i}", i % 2 == 0), name)

    n = 3 * BLOCK + 5
    now = [one(i, i % 3 != 0) for i in range(n)]
    kept = _Judged(list(now))
    for verb in (FILTER, PRIORITIZE):
        kept.text(verb)
    for step, i in enumerate((0, BLOCK, BLOCK + 1, n - 1, 7, 0)):
        now[i] = one(i + step, step % 2 == 0)
        kept.set(i, now[i])
        fresh = _Judged(list(now))
        for verb in (FILTER, PRIORITIZE):
            assert kept.text(verb) == fresh.text(verb)
            json.loads(kept.text(verb))
        assert kept.none_passed() == fresh.none_passed() == (not any(r.passed for r in now))


def test_a_pods_demand_is_kept_by_its_text_for_the_next_verb(server: tuple[ExtenderServer, FakeBinder]) -> None:
    srv, binder = server
    c = Conn(srv.port)
    p = pod("kept", containers=[container("c", mem="4")])
    compact = json.dumps(args(p, ["busy", "idle"]), separators=(",", ":")).encode()
    assert c.call("POST", "/filter", raw=compact)[0] == 200
    assert c.call("POST", "/prioritize", raw=compact)[0] == 200
    assert binder.seen[0] is binder.seen[1]  # parsed once
    rest = compact[: compact.index(b',"NodeNames"')] + b"}"
    assert srv.extender._pods[rest] is binder.seen[0]
    # Another pod's text is another demand; a bad pod is never kept.
    for k in range(20):
        other = json.dumps(args(pod(f"o{k}"), ["idle"]), separators=(",", ":")).encode()
        assert c.call("POST", "/filter", raw=other)[0] == 200
    assert rest not in srv.extender._pods and len(srv.extender._pods) == 16
    bad = b'{"Pod":3,"NodeNames":["idle"]}'
    assert c.call("POST", "/filter", raw=bad)[0] == 400
    assert b'{"Pod":3}' not in srv.extender._pods


def test_kept_answers_take_a_nodes_new_view_where_it_arrives(
    server: tuple[ExtenderServer, FakeBinder], cluster: ClusterState
) -> None:
    srv, _ = server
    c = Conn(srv.port)
    names = ["busy", "idle", "ghost"]
    p = pod(containers=[container("c", mem="8")])
    for _ in range(2):
        c.call("POST", "/filter", args(p, names))
    memo = next(iter(srv.extender._memos.values()))
    assert memo.generation == cluster.generation
    # A view arrives: the kept answer is current at once, no request needed.
    cluster.set_state("busy", "10.0.0.1:9455", node("busy", gpus=[gpu(0), gpu(1)], revision=2))
    assert memo.generation == cluster.generation
    assert memo.judged.judged[0].passed == '"busy"'
    # A write the writer does not patch (a node gone): the answer falls
    # behind, later views leave it so, and the next request catches up.
    cluster.remove("idle")
    cluster.set_state("busy", "10.0.0.1:9455", node("busy", gpus=[gpu(0, used=12), gpu(1, used=12)], revision=3))
    assert memo.generation < cluster.generation
    _, out = c.call("POST", "/filter", args(p, names))
    assert out["NodeNames"] == [] and "unknown to cgpu-scheduler" in out["FailedAndUnresolvableNodes"]["idle"]
    assert "no GPU has 8 GiB free" in out["FailedNodes"]["busy"] and memo.generation == cluster.generation
    # While a request holds the kept answers, a view is not waited for.
    with srv.extender._memo_lock:
        cluster.set_state("busy", "10.0.0.1:9455", node("busy", gpus=[gpu(0), gpu(1)], revision=4))
    assert memo.generation < cluster.generation
    _, out = c.call("POST", "/filter", args(p, names))
    assert out["NodeNames"] == ["busy"]


# ---- --pick-at-filter: the filter passes the node prioritize would score highest ----------


@pytest.fixture
def picking(cluster: ClusterState) -> Iterator[ExtenderServer]:
    srv = ExtenderServer(cluster, FakeBinder(), "127.0.0.1", 0, pick_at_filter=True).start()
    yield srv
    srv.stop()


def test_pick_at_filter_passes_the_best_scored_node_and_follows_each_new_view(
    picking: ExtenderServer, cluster: ClusterState
) -> None:
    c = Conn(picking.port)
    p = pod(containers=[container("c", mem="1")])
    _, scores = c.call("POST", "/prioritize", args(p, ALL))
    assert max(scores, key=lambda h: h["Score"])["Host"] == "busy"  # binpack: the fuller node
    for _ in range(3):  # judged afresh, kept from the second time, read from what was kept
        _, out = c.call("POST", "/filter", args(p, ALL))
        assert out["NodeNames"] == ["busy"] and out["Error"] == "", out
        # The refused nodes are reported as without the pick; the passed
        # node left out is in no list (kube-scheduler drops it silently).
        assert set(out["FailedAndUnresolvableNodes"]) == {"whole", "dead", "ghost"} and out["FailedNodes"] == {}
    # Each pick is held, after its answer went out and before the next
    # request on the connection is read.
    assert c.call("GET", "/inspect")[1]["pick_at_filter"] is True
    binder = picking.extender.binder
    assert isinstance(binder, FakeBinder) and binder.picks == [("p", "busy")] * 3
    # busy fills up: the kept answer takes its new view, and idle is picked.
    cluster.set_state("busy", "10.0.0.1:9455", node("busy", gpus=[gpu(0, used=16), gpu(1, used=16)], revision=2))
    _, out = c.call("POST", "/filter", args(p, ALL))
    assert out["NodeNames"] == ["idle"] and "busy" in out["FailedNodes"], out
    # Nothing fits: the answer is the whole filter's (no node, every reason).
    _, out = c.call("POST", "/filter", args(pod(containers=[container("c", mem="64")]), ["busy", "idle", "whole"]))
    assert out["NodeNames"] == [] and set(out["FailedNodes"]) | set(out["FailedAndUnresolvableNodes"]) == {
        "busy",
        "idle",
        "whole",
    }


def test_pick_at_filter_draws_among_nodes_of_equal_score(picking: ExtenderServer, cluster: ClusterState) -> None:
    cluster.set_state("twin", "10.0.0.5:9455", node("twin", gpus=[gpu(0), gpu(1)]))
    c = Conn(picking.port)
    picked = {
        c.call("POST", "/filter", args(pod(containers=[container("c", mem="1")]), ["idle", "twin"]))[1]["NodeNames"][0]
        for _ in range(40)
    }
    assert picked == {"idle", "twin"}  # both, as kube-scheduler draws among its best (2^-39 to miss one)


def test_pick_at_filter_with_full_node_objects(picking: ExtenderServer) -> None:
    items = [{"metadata": {"name": n}, "status": {}} for n in ("idle", "busy", "whole")]
    body = {"Pod": pod(containers=[container("c", mem="1")]), "Nodes": {"metadata": {}, "items": items}}
    _, out = Conn(picking.port).call("POST", "/filter", body)
    assert out["Nodes"]["items"] == [items[1]] and "whole" in out["FailedAndUnresolvableNodes"], out


def test_pick_at_filter_leaves_pods_it_does_not_bind_to_kube_scheduler(
    picking: ExtenderServer, cluster: ClusterState
) -> None:
    c = Conn(picking.port)
    # No GPU share asked: every node, as without the pick.
    _, out = c.call("POST", "/filter", args(pod(containers=[container("c")]), ALL))
    assert out["NodeNames"] == ALL
    # Whole GPUs (kube-scheduler binds them, and scores with its own
    # plugins): every topology node that fits.
    for name in ("topo-a", "topo-b"):
        cluster.set_state(name, "10.0.0.6:9455", node(name, gpus=[gpu(i) for i in range(4)], mode="topology"))
    whole = pod(containers=[{"name": "c", "image": "x", "resources": {"limits": {"aliyun.com/gpu": 2}}}])
    _, out = c.call("POST", "/filter", args(whole, ["topo-a", "topo-b", "idle"]))
    assert out["NodeNames"] == ["topo-a", "topo-b"], out


def test_the_best_nodes_kept_in_step_are_those_a_scan_finds() -> None:
    """_Judged.best_placed follows each node's new answer without scanning
    every node again (a bind changes one node): checked against a scan
    over random changes, ties and refusals included."""
    rng = random.Random(7)

    def answer(i: int) -> Rendered:
        if rng.random() < 0.2:
            return render(Reason("full", resolvable=True), json.dumps(f"n{i}"))
        return render(Placement(f"n{i}", ((1, 0, (0,)),), 0.5, False, rng.randrange(4)), json.dumps(f"n{i}"))

    judged = _Judged([answer(i) for i in range(12)])
    for _ in range(500):
        judged.best_placed()
        i = rng.randrange(12)
        judged.set(i, answer(i))
        scores = {k: r.answer.score for k, r in enumerate(judged.judged) if isinstance(r.answer, Placement)}
        top = max(scores.values(), default=-1)
        assert sorted(judged.best_placed()) == sorted(k for k, v in scores.items() if v == top)
