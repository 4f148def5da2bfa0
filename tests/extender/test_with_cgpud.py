"""cgpu-scheduler against real cgpud processes (simulated GPUs, Capacity API
on 127.0.0.1): filter, prioritize and bind over HTTP, the Reserve seen on the
node, a killed node refused within a second and back after its restart, TLS
with and without a trusted client certificate, and the console script."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cgpud.extender.bind import Binder
from cgpud.extender.client import CapacityError, CapacityClient, Clients, TlsFiles, get_node
from cgpud.extender.server import ExtenderServer
from cgpud.extender.state import ClusterState
from cgpud.extender.watch import Watchers
from tests.harness.extender_nodes import GIB, container, pod
from tests.harness.cgpud_nodes import BIN, Node, cgpud_nodes
from tests.harness.tls import Pki, make_pki
from tests.harness.wait import until
from tests.harness.extender_process import extender_process


@dataclass
class Extender:
    state: ClusterState
    server: ExtenderServer
    conn: http.client.HTTPConnection

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        self.conn.request(
            method,
            path,
            body=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        r = self.conn.getresponse()
        return r.status, json.loads(r.read())


@contextmanager
def extender(
    nodes: list[Node], tls: TlsFiles | None = None, addresses: dict[str, str] | None = None
) -> Iterator[Extender]:
    """An extender watching the nodes (at their own addresses, or at the
    ones given by name: what a Node's annotation may claim)."""
    state = ClusterState()
    clients = Clients(tls)
    watchers = Watchers(state, clients)
    server = ExtenderServer(state, Binder(state, clients, None), "127.0.0.1", 0).start()
    watchers.sync(addresses if addresses is not None else {n.name: n.address for n in nodes})
    try:
        yield Extender(state, server, http.client.HTTPConnection("127.0.0.1", server.port, timeout=10))
    finally:
        server.stop()
        watchers.stop()
        clients.close()


def connected(ext: Extender, name: str) -> bool:
    e = ext.state.entry(name)
    return e is not None and e.connected and e.state is not None


def filter_args(p: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"Pod": p, "Nodes": None, "NodeNames": names}


def test_filter_prioritize_bind_and_the_reservation_on_the_node(tmp_path: Path, native: Path) -> None:
    with cgpud_nodes(tmp_path, native, 2) as nodes, extender(nodes) as ext:
        names = [n.name for n in nodes]
        for n in names:
            until(lambda: connected(ext, n), what=f"{n}'s first view")
        e0 = ext.state.entry("node-0")
        assert e0 is not None and e0.state is not None
        assert [g.memory_total for g in e0.state.gpus] == [16 * GIB, 16 * GIB] and e0.state.mode == "cgpu"

        first = pod("first", [container("c", mem="10")], uid="uid-first")
        code, out = ext.call("POST", "/filter", filter_args(first, names + ["ghost"]))
        assert code == 200 and out["NodeNames"] == names and "ghost" in out["FailedAndUnresolvableNodes"]
        code, prio = ext.call("POST", "/prioritize", filter_args(first, names))
        assert code == 200 and [p["Host"] for p in prio] == names
        bind = {"PodName": "first", "PodNamespace": "default", "PodUID": "uid-first", "Node": "node-0"}
        assert ext.call("POST", "/bind", bind) == (200, {"Error": ""})

        # The node holds it: its own GetNode shows the reservation.
        view = get_node(nodes[0].address, None)
        held = [p for p in view.pods if p.reserved and p.pod_uid == "uid-first"]
        assert len(held) == 1 and held[0].gpus == ((0, 10 * GIB, 0),)
        assert view.gpus[0].memory_reserved == 10 * GIB and view.gpus[0].memory_allocated == 10 * GIB
        # The watcher's view catches up and the overlay is dropped (nothing counted twice).
        until(
            lambda: (
                (r := ext.state.record("node-0")) is not None
                and r.holds == ()
                and r.view is not None
                and r.view.gpus[0].memory_allocated == 10 * GIB
            ),
            what="the view with it",
        )
        rec = ext.state.record("node-0")
        assert rec is not None and rec.entry.state is not None and rec.entry.state.gpus[0].memory_allocated == 10 * GIB

        # Binpack now prefers node-0 (its GPU 0 ends fuller) for a 4 GiB pod.
        small = pod("small", [container("c", mem="4")], uid="uid-small")
        _, prio = ext.call("POST", "/prioritize", filter_args(small, names))
        scores = {p["Host"]: p["Score"] for p in prio}
        assert scores["node-0"] > scores["node-1"], scores
        # A 10 GiB pod on two GPUs' worth: node-0 has 6 + 16 free, node-1 16 + 16.
        pair = pod("pair", [container("c", mem="24", count="2")], uid="uid-pair")
        _, out = ext.call("POST", "/filter", filter_args(pair, names))
        assert out["NodeNames"] == ["node-1"] and "12 GiB free" in out["FailedNodes"]["node-0"]
        assert ext.call(
            "POST", "/bind", {"PodName": "pair", "PodNamespace": "default", "PodUID": "uid-pair", "Node": "node-1"}
        ) == (200, {"Error": ""})
        view1 = get_node(nodes[1].address, None)
        assert [g.memory_reserved for g in view1.gpus] == [12 * GIB, 12 * GIB]
        # Binding where it no longer fits is refused by the extender and nothing is reserved.
        again = pod("again", [container("c", mem="24", count="2")], uid="uid-again")
        ext.call("POST", "/filter", filter_args(again, names))
        code, out = ext.call(
            "POST", "/bind", {"PodName": "again", "PodNamespace": "default", "PodUID": "uid-again", "Node": "node-1"}
        )
        assert code == 200 and "no longer fits node node-1" in out["Error"]
        assert not any(p.pod_uid == "uid-again" for p in get_node(nodes[1].address, None).pods)
        # /inspect shows both nodes and the binds.
        code, inspect = ext.call("GET", "/inspect")
        assert [n["name"] for n in inspect["nodes"]] == names
        assert [b["pod"] for b in inspect["recent_binds"]] == ["default/first", "default/pair"]


def test_the_node_refuses_what_does_not_fit_and_nothing_changes(tmp_path: Path, native: Path) -> None:
    from cgpud.node.model import Share

    with cgpud_nodes(tmp_path, native, 1) as nodes:
        client = CapacityClient(nodes[0].address, None)
        try:
            before = client.get_node()
            with pytest.raises(CapacityError, match="INVALID_ARGUMENT") as e:
                client.reserve("uid-big", "default", "big", [Share(0, 20 * GIB)])
            assert e.value.code is not None and e.value.code.name == "INVALID_ARGUMENT"
            client.reserve("uid-a", "default", "a", [Share(0, 12 * GIB)])
            with pytest.raises(CapacityError, match="RESOURCE_EXHAUSTED"):
                client.reserve("uid-b", "default", "b", [Share(0, 8 * GIB)])
            after = client.get_node()
            assert after.revision == before.revision + 1
            assert [p.pod_uid for p in after.pods if p.reserved] == ["uid-a"]
            assert client.unreserve("uid-a").released
            assert not client.unreserve("uid-a").released
        finally:
            client.close()


def test_a_killed_node_is_refused_at_once_and_used_again_after_its_restart(tmp_path: Path, native: Path) -> None:
    with cgpud_nodes(tmp_path, native, 2) as nodes, extender(nodes) as ext:
        names = [n.name for n in nodes]
        for n in names:
            until(lambda: connected(ext, n), what=f"{n}'s first view")
        p = pod("p", [container("c", mem="4")], uid="uid-p")
        nodes[0].daemon.kill()
        killed = time.monotonic()

        def refused() -> dict[str, str] | None:
            _, out = ext.call("POST", "/filter", filter_args(p, names))
            return out["FailedAndUnresolvableNodes"] if out["NodeNames"] == ["node-1"] else None

        reasons = until(refused, timeout=5, what="node-0 refused")
        took = time.monotonic() - killed
        assert took < 1.0, took
        assert "Capacity stream is down" in reasons["node-0"] and "UNAVAILABLE" in reasons["node-0"]
        _, out = ext.call(
            "POST", "/bind", {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-p", "Node": "node-0"}
        )
        assert "Capacity stream is down" in out["Error"] and "not binding there" in out["Error"]
        # Back after the restart (the watcher retries with backoff up to 5 s).
        nodes[0].daemon.start()
        until(
            lambda: ext.call("POST", "/filter", filter_args(p, names))[1]["NodeNames"] == names,
            timeout=15,
            what="node-0 back",
        )
        assert ext.call(
            "POST", "/bind", {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-p", "Node": "node-0"}
        ) == (200, {"Error": ""})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_trusted_client_watches_untrusted_or_certless_clients_do_not(
    tmp_path: Path, native: Path, pki: Pki
) -> None:
    cert, key = pki.node_cert("node-0")
    tls_args = ("--capacity-tls-cert", str(cert), "--capacity-tls-key", str(key), "--capacity-tls-ca", str(pki.ca))
    with cgpud_nodes(tmp_path, native, 1, *tls_args) as nodes:
        with extender(nodes, TlsFiles(pki.client_cert, pki.client_key, pki.ca)) as ext:
            until(lambda: connected(ext, "node-0"), what="a view over TLS")
            p = pod("p", [container("c", mem="4")], uid="uid-tls")
            ext.call("POST", "/filter", filter_args(p, ["node-0"]))
            assert ext.call(
                "POST", "/bind", {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-tls", "Node": "node-0"}
            ) == (200, {"Error": ""})
        before = get_node(nodes[0].address, TlsFiles(pki.client_cert, pki.client_key, pki.ca))
        for tls in (TlsFiles(pki.untrusted_cert, pki.untrusted_key, pki.ca), TlsFiles(None, None, pki.ca)):
            with extender(nodes, tls) as ext:
                down = until(
                    lambda: (e := ext.state.entry("node-0")) is not None and "connecting" not in e.error and e,
                    what="the refusal",
                )
                assert not down.connected and down.state is None and "UNAVAILABLE" in down.error
                _, out = ext.call("POST", "/filter", filter_args(pod("q", uid="uid-q"), ["node-0"]))
                assert "node-0: cgpud's Capacity stream is down" in out["Error"], out  # retried by kube-scheduler
            with pytest.raises(CapacityError):
                CapacityClient(nodes[0].address, tls).reserve("uid-x", "default", "x", [], timeout=5)
        after = get_node(nodes[0].address, TlsFiles(pki.client_cert, pki.client_key, pki.ca))
        assert after.revision == before.revision and [p.pod_uid for p in after.pods] == ["uid-tls"]


def test_a_node_pointed_at_another_nodes_capacity_api_is_refused(tmp_path: Path, native: Path) -> None:
    """The attack: whoever may patch Nodes points node-1's
    cgpu.io/capacity-address at node-0's Capacity port. Before, filter passed
    node-1 on node-0's view and bind reserved on node-0. The view names the
    node it is of, and a view of another node is refused."""
    with (
        cgpud_nodes(tmp_path, native, 2) as nodes,
        extender(nodes, addresses={"node-0": nodes[0].address, "node-1": nodes[0].address}) as ext,
    ):
        until(lambda: connected(ext, "node-0"), what="node-0's view")
        down = until(
            lambda: (e := ext.state.entry("node-1")) is not None and "speaks for" in e.error and e,
            what="node-1 refused",
        )
        assert not down.connected and down.state is None
        assert "the Capacity API at " + nodes[0].address + " speaks for node 'node-0', not 'node-1'" in down.error
        p = pod("p", [container("c", mem="4")], uid="uid-p")
        _, out = ext.call("POST", "/filter", filter_args(p, ["node-0", "node-1"]))
        assert (
            out["NodeNames"] == ["node-0"] and "speaks for node 'node-0'" in out["FailedAndUnresolvableNodes"]["node-1"]
        )
        _, out = ext.call(
            "POST", "/bind", {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-p", "Node": "node-1"}
        )
        assert "not binding there" in out["Error"]
        assert not any(p.pod_uid == "uid-p" for p in get_node(nodes[0].address, None).pods)


def test_with_tls_a_node_answers_only_under_its_own_certificate(tmp_path: Path, native: Path, pki: Pki) -> None:
    """Per-node server certificates: node-0's cgpud, holding node-0's key,
    cannot answer for node-1 (the extender checks the certificate names the
    Node it dials for), and a node with another node's certificate is not
    trusted as itself."""

    def tls_args(name: str) -> tuple[str, ...]:
        cert, key = pki.node_cert(name)
        return ("--capacity-tls-cert", str(cert), "--capacity-tls-key", str(key), "--capacity-tls-ca", str(pki.ca))

    client = TlsFiles(pki.client_cert, pki.client_key, pki.ca)
    with cgpud_nodes(tmp_path / "a", native, 1, *tls_args("node-0")) as nodes:
        with extender(nodes, client, addresses={"node-0": nodes[0].address, "node-1": nodes[0].address}) as ext:
            until(lambda: connected(ext, "node-0"), what="node-0's view over TLS")
            down = until(
                lambda: (e := ext.state.entry("node-1")) is not None and "connecting" not in e.error and e,
                what="node-1 refused",
            )
            assert not down.connected and down.state is None and "UNAVAILABLE" in down.error
    # a node that runs with node-0's certificate (a stolen key) is not node-1
    with cgpud_nodes(tmp_path / "b", native, 2, *tls_args("node-0")) as nodes, extender(nodes, client) as ext:
        until(lambda: connected(ext, "node-0"), what="node-0's view over TLS")
        down = until(
            lambda: (e := ext.state.entry("node-1")) is not None and "connecting" not in e.error and e,
            what="node-1 refused",
        )
        assert not down.connected and down.state is None


def test_the_console_script_serves_and_stops_on_sigterm(tmp_path: Path, native: Path) -> None:
    with cgpud_nodes(tmp_path, native, 1) as nodes:
        node_file = tmp_path / "nodes"
        node_file.write_text(f"# test\n{nodes[0].name} {nodes[0].address}\n")
        with extender_process(tmp_path / "scheduler.log", "--nodes", str(node_file)) as (proc, port):

            def inspect() -> dict[str, Any] | None:
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                    c.request("GET", "/inspect")
                    data = json.loads(c.getresponse().read())
                except OSError:
                    return None
                return data if data["nodes"] and data["nodes"][0]["connected"] else None

            data = until(inspect, what="the scheduler's view")
            assert data["nodes"][0]["state"]["gpus"][0]["memory_total"] == 16 * GIB
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        assert "stopping" in (tmp_path / "scheduler.log").read_text()


def refusal(*args: str) -> str:
    """cgpu-scheduler's stderr for flags it must refuse with a usage error
    (exit 2). Outside a pod: with no --nodes it may not fall back on the
    API server, so KUBERNETES_SERVICE_HOST is dropped."""
    done = subprocess.run(
        [str(BIN / "cgpu-scheduler"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"},
    )
    assert done.returncode == 2, done.stderr
    return done.stderr


def test_bad_flags_are_refused_with_a_message(tmp_path: Path) -> None:
    assert "no nodes: give --nodes FILE" in refusal("--listen", "127.0.0.1:0")
    bad = tmp_path / "nodes"
    bad.write_text("node-1 nowhere\n")
    assert "line 1: 'node-1 nowhere' is not `NAME HOST:PORT`" in refusal("--listen", "127.0.0.1:0", "--nodes", str(bad))
    assert "--listen 'nowhere' is not HOST:PORT" in refusal("--listen", "nowhere", "--nodes", str(bad))


def test_concurrent_binds_never_overcommit_a_node(tmp_path: Path, native: Path) -> None:
    """Twelve 4 GiB pods bound at once to one node of 2 x 16 GiB: the
    extender's view and the node's admission together let exactly 8 in."""
    import concurrent.futures

    with cgpud_nodes(tmp_path, native, 1) as nodes, extender(nodes) as ext:
        until(lambda: connected(ext, "node-0"), what="the first view")
        port = ext.server.port

        def one(i: int) -> str:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
            p = pod(f"p{i}", [container("c", mem="4")], uid=f"uid-{i}")
            c.request("POST", "/filter", json.dumps(filter_args(p, ["node-0"])).encode())
            json.loads(c.getresponse().read())
            c.request(
                "POST",
                "/bind",
                json.dumps(
                    {"PodName": f"p{i}", "PodNamespace": "default", "PodUID": f"uid-{i}", "Node": "node-0"}
                ).encode(),
            )
            error = json.loads(c.getresponse().read())["Error"]
            c.close()
            return str(error)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            errors = list(pool.map(one, range(12)))
        assert sum(1 for e in errors if e == "") == 8, errors
        assert all("no GPU has 4 GiB free" in e or "RESOURCE_EXHAUSTED" in e for e in errors if e), errors
        view = get_node(nodes[0].address, None)
        assert [g.memory_allocated for g in view.gpus] == [16 * GIB, 16 * GIB]
        assert len([p for p in view.pods if p.reserved]) == 8


@pytest.mark.slow
def test_a_node_that_stops_answering_is_refused_after_the_keepalive(tmp_path: Path, native: Path) -> None:
    """A frozen cgpud keeps its TCP connection open (the kernel answers for
    it): only the missing keepalive pong tells, 15 + 5 s later."""
    with cgpud_nodes(tmp_path, native, 1) as nodes, extender(nodes) as ext:
        until(lambda: connected(ext, "node-0"), what="the first view")
        proc = nodes[0].daemon.proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            until(lambda: not connected(ext, "node-0"), timeout=30, what="the keepalive to fail")
            took = time.monotonic() - frozen
            entry = ext.state.entry("node-0")
            assert entry is not None and "ping timeout" in entry.error and 14 < took < 25, (took, entry.error)
            _, out = ext.call("POST", "/filter", filter_args(pod("p", uid="uid-p"), ["node-0"]))
            # the only node, down for now: an error, which kube-scheduler retries
            assert "node-0: cgpud's Capacity stream is down" in out["Error"], out
        finally:
            proc.send_signal(signal.SIGCONT)
        until(lambda: connected(ext, "node-0"), timeout=15, what="the node back")
