"""kubectl inspect cgpu: ACK's tables from a ClusterView (golden text), and
the ways the view is fetched: cgpu-scheduler's GET /inspect, the API
server's service proxy (a small HTTP server on the real path, the real
`kubernetes` client), and the real kubectl's plugin dispatch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from cgpud.cli import kubectl_inspect as ki
from cgpud.extender.model import ClusterView, GpuState, NodeEntry, NodeState, PodShare, view_from_json, view_to_json
from tests.harness.api_server import write_kubeconfig
from tests.harness.net import send_json, serving

GIB = 1 << 30
MIB = 1 << 20
V100 = 16160 * MIB  # a "16 GB" V100: 15.78 GiB, shown as 15


def gpu(
    index: int, allocated: int, total: int = V100, healthy: bool = True, reason: str = "", core: int = 0
) -> GpuState:
    return GpuState(
        index=index,
        uuid=f"GPU-{index:08d}",
        model="Tesla V100-SXM2-16GB",
        memory_total=total,
        memory_allocated=allocated,
        core_allocated=core,
        instances=1,
        max_instances=20,
        healthy=healthy,
        health_reason=reason,
    )


def node(
    name: str,
    gpus: tuple[GpuState, ...],
    pods: tuple[PodShare, ...] = (),
    mode: str = "cgpu",
    address: str = "192.0.2.109",
    other: int = 0,
) -> NodeState:
    return NodeState(
        name=name,
        incarnation="i1",
        revision=7,
        addresses=(address,),
        mode=mode,
        placement="binpack",
        core_step=5,
        card_name="Tesla V100-SXM2-16GB",
        gpus=gpus,
        pods=pods,
        other_instances=other,
    )


def entry(state: NodeState, connected: bool = True, error: str = "") -> NodeEntry:
    return NodeEntry(state.name, f"{state.addresses[0]}:9455", connected, error, state)


def pod(
    name: str,
    *gpus: tuple[int, int, int],
    namespace: str = "default",
    uid: str = "",
    container: str = "main",
    reserved: bool = False,
) -> PodShare:
    return PodShare(uid or f"uid-{name}", namespace, name, "" if reserved else container, gpus, reserved)


# ---- the summary table -------------------------------------------------------------------

ACK_NODE = node("cn-shanghai.192.0.2.109", (gpu(0, 15 * GIB), gpu(1, 9 * GIB)))


def test_the_summary_is_acks_table_to_the_character():
    # FIELD-NOTES, "Inspect output": the same node, the same text.
    assert ki.summary(ClusterView((entry(ACK_NODE),))) == (
        "NAME                       IPADDRESS      GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU Memory(GiB)\n"
        "cn-shanghai.192.0.2.109    192.0.2.109    15/15                  9/15                   24/30\n"
        "------------------------------------------------------------------------------\n"
        "Allocated/Total GPU Memory In Cluster:\n"
        "24/30 (80%)\n"
    )


def test_gib_like_ack_totals_down_allocations_up_percent_truncated():
    n = node("n1", (gpu(0, 1, total=16 * GIB - 1), gpu(1, 3 * GIB + 1, total=40 * GIB)))
    out = ki.summary(ClusterView((entry(n),)))
    rows = out.splitlines()
    assert rows[1].split()[2:] == ["1/15", "4/40", "5/55"]
    assert rows[-1] == "5/55 (9%)"  # 9.09 %, truncated as ACK does (20/56 is 35 %)
    assert ki._percent(20, 56) == 35 and ki._percent(0, 0) == 0


def test_nodes_with_fewer_gpus_show_dashes_and_the_cluster_adds_up():
    a = node("a", (gpu(0, 2 * GIB), gpu(1, 0)), address="10.0.0.1")
    b = node(
        "b",
        (gpu(0, 4 * GIB, total=80 * GIB), gpu(1, 0, total=80 * GIB), gpu(2, 8 * GIB, total=80 * GIB)),
        address="10.0.0.2",
    )
    rows = ki.summary(ClusterView((entry(a), entry(b)))).splitlines()
    assert rows[0].split() == [
        "NAME",
        "IPADDRESS",
        "GPU0(Allocated/Total)",
        "GPU1(Allocated/Total)",
        "GPU2(Allocated/Total)",
        "GPU",
        "Memory(GiB)",
    ]
    assert rows[1].split() == ["a", "10.0.0.1", "2/15", "0/15", "-", "2/30"]
    assert rows[2].split() == ["b", "10.0.0.2", "4/80", "0/80", "8/80", "12/240"]
    assert rows[-1] == "14/270 (5%)"


def test_a_node_whose_stream_is_down_is_listed_with_its_reason_and_no_stale_numbers():
    up = entry(ACK_NODE)
    # The last view it had says 14 GiB allocated: not shown, not counted.
    stale = node("gpu-3", (gpu(0, 14 * GIB), gpu(1, 0)), address="10.9.9.9")
    down = NodeEntry("gpu-3", "10.0.0.3:9455", False, "failed to connect to all addresses", stale)
    waiting = NodeEntry("gpu-4", "[fd00::4]:9455", True, "", None)
    out = ki.summary(ClusterView((up, down, waiting)))
    rows = out.splitlines()
    assert rows[2].split() == ["gpu-3", "10.0.0.3", "-", "-", "-"]
    assert rows[3].split() == ["gpu-4", "fd00::4", "-", "-", "-"]
    assert "14/" not in out and "10.9.9.9" not in out
    assert rows[5:] == [
        "Allocated/Total GPU Memory In Cluster:",
        "24/30 (80%)",
        "Not counted (no current view):",
        "  gpu-3: capacity stream down: failed to connect to all addresses",
        "  gpu-4: no view from its cgpud yet",
    ]


def test_an_unhealthy_gpu_is_marked_and_named():
    n = node("n1", (gpu(0, 0), gpu(1, 4 * GIB, healthy=False, reason="XID 79: fallen off the bus")))
    rows = ki.summary(ClusterView((entry(n),))).splitlines()
    assert rows[1].split()[2:4] == ["0/15", "4/15*"]
    assert rows[-2:] == ["Unhealthy GPUs (*), not placed on:", "  n1 GPU1: XID 79: fallen off the bus"]


def test_an_empty_cluster():
    assert ki.summary(ClusterView(())).splitlines()[-1] == "0/0 (0%)"


# ---- -d --------------------------------------------------------------------------------------


def test_details_are_acks_layout_to_the_character():
    # The layout of ACK's `-d` (totals written into the pods' table, so they line up).
    gpus = tuple(gpu(i, a * GIB, total=14 * GIB + 512 * MIB) for i, a in enumerate((6, 14, 0, 0)))
    n = node(
        "k8s-gpu1",
        gpus,
        address="172.16.33.69",
        pods=(
            pod("binpack-6-7d9f48946c-9strc", (0, 6 * GIB, 0)),
            pod("binpack-10-6b5fcd9ddc-wzdzv", (1, 10 * GIB, 0)),
            pod("binpack-4-5c857c579-5shjc", (1, 4 * GIB, 0)),
        ),
    )
    assert ki.details(ClusterView((entry(n),))) == (
        "NAME:       k8s-gpu1\n"
        "IPADDRESS:  172.16.33.69\n"
        "\n"
        "NAME                         NAMESPACE  GPU0(Allocated)  GPU1(Allocated)  GPU2(Allocated)  GPU3(Allocated)\n"
        "binpack-10-6b5fcd9ddc-wzdzv  default    0                10               0                0\n"
        "binpack-4-5c857c579-5shjc    default    0                4                0                0\n"
        "binpack-6-7d9f48946c-9strc   default    6                0                0                0\n"
        "Allocated :                  20 (35%)\n"
        "Total :                      56\n"
        "------------------------------------------------------------------------------\n"
        "\n"
        "Allocated/Total GPU Memory In Cluster:  20/56 (35%)\n"
    )


def test_details_add_up_a_pods_containers_and_mark_reservations():
    n = node(
        "n1",
        (gpu(0, 7 * GIB), gpu(1, 6 * GIB)),
        pods=(
            pod("web", (0, 2 * GIB, 0), container="a"),
            pod("web", (0, 1 * GIB, 0), (1, 1 * GIB, 0), container="b"),
            pod("train", (0, 3 * GIB, 0), (1, 5 * GIB, 0), namespace="ml", reserved=True),
        ),
        other=2,
    )
    rows = ki.details(ClusterView((entry(n),))).splitlines()
    assert rows[3].split() == ["NAME", "NAMESPACE", "GPU0(Allocated)", "GPU1(Allocated)"]
    assert rows[4].split() == ["web", "default", "3", "1"]
    assert rows[5].split() == ["train(reserved)", "ml", "3", "5"]
    assert rows[6].split() == ["Allocated", ":", "13", "(43%)"]
    assert rows[8].split() == ["Not", "pods", ":", "2", "instances", "(in", "Allocated)"]


def test_details_show_pods_holding_whole_gpus_one_row_each():
    """Whole GPUs come from the kubelet's pod-resources, without pod UIDs:
    two pods are still two rows."""
    n = node(
        "n1",
        (gpu(0, 16 * GIB), gpu(1, 16 * GIB)),
        pods=(
            PodShare("", "ml", "a", "main", ((0, 16 * GIB, 100),)),
            PodShare("", "ml", "b", "main", ((1, 16 * GIB, 100),)),
        ),
    )
    rows = ki.details(ClusterView((entry(n),))).splitlines()
    assert [r.split() for r in rows[4:6]] == [["a", "ml", "16", "0"], ["b", "ml", "0", "16"]]


def test_details_show_a_core_column_on_core_mem_nodes_only():
    shares = (pod("a", (0, 2 * GIB, 30)), pod("b", (0, 1 * GIB, 0)))
    cm = ki.details(ClusterView((entry(node("cm", (gpu(0, 3 * GIB),), shares, mode="core_mem")),))).splitlines()
    assert cm[3].split()[-1] == "CORE(%)"
    assert [r.split()[-1] for r in cm[4:6]] == ["30", "-"]
    plain = ki.details(ClusterView((entry(node("c", (gpu(0, 3 * GIB),), shares)),))).splitlines()
    assert "CORE(%)" not in plain[3]


def test_details_of_a_down_node_give_its_reason_and_an_unhealthy_gpu_is_named():
    sick = node("n1", (gpu(0, 0), gpu(1, 0, healthy=False, reason="XID 48: double-bit ECC")))
    down = NodeEntry("n2", "10.0.0.2:9455", False, "deadline exceeded", ACK_NODE)
    out = ki.details(ClusterView((entry(sick), down)))
    assert "Unhealthy: GPU1*: XID 48: double-bit ECC\n" in out
    assert "NAME:       n2\nIPADDRESS:  10.0.0.2\n\nNot counted: capacity stream down: deadline exceeded\n" in out
    assert out.endswith("Allocated/Total GPU Memory In Cluster:  0/30 (0%)\n")


# ---- sources and the command line -----------------------------------------------------------

VIEW = ClusterView((entry(ACK_NODE), NodeEntry("gpu-3", "10.0.0.3:9455", False, "connection refused", None)))


@contextmanager
def http_server(routes: dict[str, tuple[int, bytes]]) -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server answering GET path -> (status, body); yields its
    base URL and the (URL-decoded) paths asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = unquote(self.path.split("?", 1)[0])
            asked.append(path)
            send_json(self, *routes.get(path, (404, b'{"kind":"Status","message":"no such path"}')))

        def log_message(self, *args: object) -> None:
            pass

    with serving(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as port:
        yield f"http://127.0.0.1:{port}", asked


def view_body(view: ClusterView = VIEW) -> bytes:
    return json.dumps(view_to_json(view)).encode()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = ki.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_from_the_extender_table_details_and_json(capsys):
    with http_server({"/inspect": (200, view_body())}) as (url, asked):
        code, out, err = run(capsys, "--extender", url)
        assert (code, err) == (0, "") and out == ki.summary(VIEW)
        # As kubectl's name for it when run by hand: a leading "cgpu" is the plugin's own name.
        code, out, _ = run(capsys, "cgpu", "-d", "--extender", url + "/")
        assert code == 0 and out == ki.details(VIEW)
        code, out, _ = run(capsys, "-o", "json", "--extender", url)
        assert code == 0 and view_from_json(json.loads(out)) == VIEW
    assert asked == ["/inspect"] * 3


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, b"<html>not json</html>", "did not answer with a cgpu cluster view"),
        (200, b'{"nodes": [{"name": "x"}]}', "did not answer with a cgpu cluster view"),
        (503, b"no view yet", "answered 503"),
    ],
)
def test_a_bad_answer_is_one_line_and_exit_1(capsys, status, body, says):
    with http_server({"/inspect": (status, body)}) as (url, _):
        code, out, err = run(capsys, "--extender", url)
    assert code == 1 and out == ""
    assert err.startswith("kubectl inspect cgpu: ") and says in err and err.count("\n") == 1


def test_an_unreachable_extender_is_one_line_and_exit_1(capsys):
    with http_server({}) as (url, _):
        pass  # closed: nothing listens on its port now
    code, out, err = run(capsys, "--extender", url, "--timeout", "5")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"cannot reach cgpu-scheduler at {url}/inspect" in err


def test_bad_arguments(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        ki.main(["-o", "yaml"])
    assert exit_.value.code == 2
    code, _, err = run(capsys, "--extender", "localhost:1")
    assert code == 1 and "give a URL" in err
    bad = tmp_path / "nodes"
    bad.write_text("# comment\nn1 10.0.0.1:9455\nn2\n")
    code, _, err = run(capsys, "--nodes", str(bad))
    assert code == 1 and f"{bad} line 3: 'n2' is not `NAME HOST:PORT`" in err
    code, _, err = run(capsys, "--nodes", str(tmp_path / "absent"))
    assert code == 1 and "cannot read the node file" in err
    code, _, err = run(capsys, "--nodes", str(tmp_path / "nodes"), "--tls-cert", "c.pem")
    assert code == 1 and "--tls-cert, --tls-key and --tls-ca go together" in err


PROXY = "/api/v1/namespaces/kube-system/services/https:cgpu-scheduler:https/proxy/inspect"
PLAIN = "/api/v1/namespaces/gpu/services/sched:http/proxy/inspect"


def test_through_the_api_servers_service_proxy(capsys, tmp_path, monkeypatch):
    """The HTTPS port of deploy/cgpu-scheduler.yaml first; an extender
    serving plain HTTP (no port named https: 503) on its http port."""
    routes = {
        PROXY: (200, view_body()),
        "/api/v1/namespaces/gpu/services/https:sched:https/proxy/inspect": (503, b'{"message": "no port"}'),
        PLAIN: (200, view_body(ClusterView(()))),
    }
    with http_server(routes) as (url, asked):
        config = write_kubeconfig(tmp_path / "kubeconfig", url)
        code, out, err = run(capsys, "--kubeconfig", str(config))
        assert (code, err) == (0, "") and out == ki.summary(VIEW)
        monkeypatch.setenv("KUBECONFIG", str(config))  # what kubectl itself would use
        code, out, _ = run(capsys, "-n", "gpu", "--service", "sched")
        assert code == 0 and out.splitlines()[-1] == "0/0 (0%)"
        code, _, err = run(capsys, "-n", "elsewhere")
        assert code == 1 and err.count("\n") == 1
        assert (
            "cannot read the cluster view from service elsewhere/cgpu-scheduler (port https, else http) through "
            "the API server: 404 no such path" in err
        )
    assert asked == [
        PROXY,
        "/api/v1/namespaces/gpu/services/https:sched:https/proxy/inspect",
        PLAIN,
        "/api/v1/namespaces/elsewhere/services/https:cgpu-scheduler:https/proxy/inspect",
        "/api/v1/namespaces/elsewhere/services/cgpu-scheduler:http/proxy/inspect",
    ]


def test_no_kubeconfig_and_not_in_a_pod_says_what_to_give(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out, err = run(capsys)
    assert code == 1 and out == "" and "give --extender URL or --nodes FILE" in err


def test_the_real_kubectl_finds_the_plugin_and_passes_it_its_arguments(tmp_path):
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is not installed"
    plugin = Path(sys.executable).parent / "kubectl-inspect-cgpu"
    assert plugin.is_file(), "the console script is not installed (pip install -e .)"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl-inspect-cgpu").symlink_to(plugin)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": "/dev/null"}
    listed = subprocess.run([kubectl, "plugin", "list"], capture_output=True, text=True, env=env, timeout=60)
    assert f"{bin_dir}/kubectl-inspect-cgpu" in listed.stdout
    with http_server({"/inspect": (200, view_body())}) as (url, _):
        done = subprocess.run(
            [kubectl, "inspect", "cgpu", "--extender", url], capture_output=True, text=True, env=env, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == ki.summary(VIEW)
        detailed = subprocess.run(
            [kubectl, "inspect", "cgpu", "-d", "--extender", url], capture_output=True, text=True, env=env, timeout=60
        )
        assert detailed.stdout == ki.details(VIEW)
    failed = subprocess.run(
        [kubectl, "inspect", "cgpu", "--extender", url], capture_output=True, text=True, env=env, timeout=60
    )
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.startswith("kubectl inspect cgpu: cannot reach cgpu-scheduler")


def test_json_is_the_views_json():
    view = ClusterView((entry(replace(ACK_NODE, pods=(pod("a", (0, GIB, 0)),))),))
    assert view_from_json(json.loads(ki.as_json(view))) == view


def node_view_pb(name: str, address: str) -> Any:
    from cgpud.api.cgpu.v1 import capacity_pb2 as pb

    return pb.NodeView(
        incarnation="i9",
        revision=3,
        node_name=name,
        addresses=[address],
        mode="cgpu",
        placement="binpack",
        core_step=5,
        card=pb.CardModel(name="Tesla V100-SXM2-16GB", memory_bytes=V100, count=2),
        gpus=[
            pb.GpuView(
                index=i,
                uuid=f"GPU-{i}",
                model="Tesla V100-SXM2-16GB",
                memory_total_bytes=V100,
                memory_allocated_bytes=a,
                instances=1,
                max_instances=20,
                healthy=True,
            )
            for i, a in enumerate((15 * GIB, 9 * GIB))
        ],
        pod_instances=[
            pb.PodInstance(
                instance_id="x",
                pod_uid="u1",
                pod_namespace="default",
                pod_name="web",
                container="main",
                shares=[pb.Share(gpu_index=1, memory_bytes=9 * GIB)],
            )
        ],
        reservations=[
            pb.Reservation(
                pod_uid="u2",
                pod_namespace="ml",
                pod_name="train",
                shares=[pb.Share(gpu_index=0, memory_bytes=15 * GIB)],
            )
        ],
    )


@contextmanager
def capacity_server(view: Any, pki: Any) -> Iterator[str]:
    """A real gRPC Capacity server on loopback with TLS that requires a
    client certificate of the test CA; GetNode answers `view`."""
    from concurrent import futures

    import grpc

    from cgpud.api.cgpu.v1 import capacity_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.CapacityServicer):
        def GetNode(self, request: Any, context: Any) -> Any:
            return view

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_CapacityServicer_to_server(Servicer(), server)
    credentials = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_from_each_nodes_cgpud_with_client_certificates(capsys, tmp_path):
    from tests.harness.tls import make_pki

    pki = make_pki(tmp_path / "pki")
    with http_server({}) as (closed, _):
        pass
    dead = closed.rsplit(":", 1)[1]
    with capacity_server(node_view_pb("gpu-1", "192.0.2.109"), pki) as address:
        nodes = tmp_path / "nodes"
        nodes.write_text(f"# the nodes\ngpu-1 {address}\ngpu-2 127.0.0.1:{dead}\n")
        tls = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key), "--tls-ca", str(pki.ca)]
        code, out, err = run(capsys, "--nodes", str(nodes), *tls, "--timeout", "5")
        assert (code, err) == (0, "")
        rows = out.splitlines()
        assert rows[1].split() == ["gpu-1", "192.0.2.109", "15/15", "9/15", "24/30"]
        assert rows[2].split() == ["gpu-2", "127.0.0.1", "-", "-", "-"]
        assert rows[4:6] == ["Allocated/Total GPU Memory In Cluster:", "24/30 (80%)"]
        assert rows[7].startswith(f"  gpu-2: capacity stream down: GetNode at 127.0.0.1:{dead}: UNAVAILABLE")
        code, out, _ = run(capsys, "-d", "--nodes", str(nodes), *tls, "--timeout", "5")
        assert code == 0
        assert [r.split() for r in out.splitlines()[4:6]] == [
            ["web", "default", "0", "9"],
            ["train(reserved)", "ml", "15", "0"],
        ]
        # A client certificate of another CA is refused by the node: it is down, with the reason.
        other = ["--tls-cert", str(pki.untrusted_cert), "--tls-key", str(pki.untrusted_key), "--tls-ca", str(pki.ca)]
        code, out, err = run(capsys, "--nodes", str(nodes), *other, "--timeout", "5")
        assert code == 0 and err == ""
        # No node has a current view: no GPU columns, nothing counted.
        assert out.splitlines()[:3] == [
            "NAME     IPADDRESS    GPU Memory(GiB)",
            "gpu-1    127.0.0.1    -",
            "gpu-2    127.0.0.1    -",
        ]
        assert "0/0 (0%)\nNot counted (no current view):\n  gpu-1: capacity stream down: GetNode at" in out
