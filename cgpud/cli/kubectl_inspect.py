"""`kubectl inspect cgpu [-d] [-o json]`: ACK's GPU share table for the whole
cluster, as `kubectl inspect cgpushare` users know it.

kubectl runs this console script (kubectl-inspect-cgpu on PATH) for
`kubectl inspect cgpu ...` with the arguments after `inspect cgpu`; run by
hand it also takes a leading `cgpu`.

Where the view comes from, first that applies:
- `--extender URL`: cgpu-scheduler's `GET URL/inspect`;
- `--nodes FILE`: every node's cgpud directly (its Capacity API's GetNode),
  the node file cgpu-scheduler reads (`NAME HOST:PORT` a line);
- otherwise cgpu-scheduler through the API server's service proxy
  (`/api/v1/namespaces/NS/services/https:SERVICE:https/proxy/inspect`, else
  `SERVICE:http`) with the
  kubeconfig kubectl would use.

The formatting functions take a ClusterView and return text. Memory is in
whole GiB as ACK shows it: totals rounded down (a 16 GB card is 15),
allocations rounded up (never under-reported), percentages truncated. A node
whose view is not current is listed with its reason, never with numbers
from a stale view."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cgpud.cli.inspect import RULE, _gib_down, _gib_up, _table
from cgpud.errors import CgpuError, UsageError
from cgpud.extender.model import ClusterView, GpuState, NodeEntry, NodeState, PodShare, view_from_json, view_to_json
from cgpud.logs import run_command

if TYPE_CHECKING:
    from cgpud.extender.client import TlsFiles

PROG = "kubectl inspect cgpu"
DEFAULT_NAMESPACE = "kube-system"
DEFAULT_SERVICE = "cgpu-scheduler"
DEFAULT_TIMEOUT = 10.0
MAX_VIEW_BYTES = 64 << 20  # a view of thousands of nodes is a few MB; anything past this is not one
UNHEALTHY_MARK = "*"
RESERVED_MARK = "(reserved)"
CORE_MODE = "core_mem"


class InspectError(CgpuError):
    """The cluster view could not be had."""


# ---- formatting ------------------------------------------------------------------------


def _percent(part: int, whole: int) -> int:
    """Truncated, as ACK prints it (20/56 is 35%)."""
    return 100 * part // whole if whole else 0


def _current(entry: NodeEntry) -> NodeState | None:
    """The node's view when it is current: its stream is up and a view came."""
    return entry.state if entry.connected and entry.state is not None else None


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "-"


def _ip(entry: NodeEntry) -> str:
    state = _current(entry)
    if state is not None and state.addresses:
        return state.addresses[0]
    return _host(entry.capacity_address)


def _why_not_current(entry: NodeEntry) -> str:
    if not entry.connected:
        return f"capacity stream down: {entry.error or 'not connected'}"
    return "no view from its cgpud yet"


def _gpu_columns(view: ClusterView) -> list[int]:
    return sorted({g.index for e in view.nodes if (s := _current(e)) is not None for g in s.gpus})


def _node_totals(state: NodeState) -> tuple[int, int]:
    return sum(_gib_up(g.memory_allocated) for g in state.gpus), sum(_gib_down(g.memory_total) for g in state.gpus)


def _cluster_totals(view: ClusterView) -> tuple[int, int]:
    allocated = total = 0
    for e in view.nodes:
        if (s := _current(e)) is not None:
            a, t = _node_totals(s)
            allocated, total = allocated + a, total + t
    return allocated, total


def _gpu_cell(gpu: GpuState | None) -> str:
    if gpu is None:
        return "-"
    cell = f"{_gib_up(gpu.memory_allocated)}/{_gib_down(gpu.memory_total)}"
    return cell + ("" if gpu.healthy else UNHEALTHY_MARK)


def _notes(view: ClusterView) -> list[str]:
    lines: list[str] = []
    absent = [(e.name, _why_not_current(e)) for e in view.nodes if _current(e) is None]
    if absent:
        lines.append("Not counted (no current view):")
        lines += [f"  {name}: {why}" for name, why in absent]
    sick = [(e.name, g) for e in view.nodes if (s := _current(e)) is not None for g in s.gpus if not g.healthy]
    if sick:
        lines.append(f"Unhealthy GPUs ({UNHEALTHY_MARK}), not placed on:")
        lines += [f"  {name} GPU{g.index}: {g.health_reason or 'unhealthy'}" for name, g in sick]
    return lines


def summary(view: ClusterView) -> str:
    """`kubectl inspect cgpu`: one row per node, then the cluster's totals."""
    columns = _gpu_columns(view)
    rows = [["NAME", "IPADDRESS", *[f"GPU{i}(Allocated/Total)" for i in columns], "GPU Memory(GiB)"]]
    for e in view.nodes:
        state = _current(e)
        if state is None:
            rows.append([e.name, _ip(e), *["-" for _ in columns], "-"])
            continue
        by_index = {g.index: g for g in state.gpus}
        allocated, total = _node_totals(state)
        rows.append([e.name, _ip(e), *[_gpu_cell(by_index.get(i)) for i in columns], f"{allocated}/{total}"])
    allocated, total = _cluster_totals(view)
    lines = [
        *_table(rows, wide_first=2),
        RULE,
        "Allocated/Total GPU Memory In Cluster:",
        f"{allocated}/{total} ({_percent(allocated, total)}%)",
        *_notes(view),
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _PodRow:
    namespace: str
    name: str
    reserved: bool
    memory: dict[int, int]  # GPU index -> bytes
    core: dict[int, int]  # GPU index -> percent


def _pod_rows(pods: Sequence[PodShare]) -> list[_PodRow]:
    """One row per pod (its containers' shares added up); a pod's
    reservation not yet consumed is a row of its own."""
    rows: dict[tuple[str, bool], _PodRow] = {}
    for p in pods:
        # A pod's whole GPUs come without a UID (the kubelet's pod-resources): its name then.
        key = (p.pod_uid or f"{p.pod_namespace}/{p.pod_name}", p.reserved)
        row = rows.setdefault(key, _PodRow(p.pod_namespace, p.pod_name, p.reserved, {}, {}))
        for index, memory, core in p.gpus:
            row.memory[index] = row.memory.get(index, 0) + memory
            row.core[index] = row.core.get(index, 0) + core
    return sorted(rows.values(), key=lambda r: (r.namespace, r.name, r.reserved))


def _node_details(entry: NodeEntry) -> list[str]:
    lines = [f"NAME:       {entry.name}", f"IPADDRESS:  {_ip(entry)}", ""]
    state = _current(entry)
    if state is None:
        return lines + [f"Not counted: {_why_not_current(entry)}", RULE]
    core = state.mode == CORE_MODE
    gpus = [g.index for g in state.gpus]
    rows = [["NAME", "NAMESPACE", *[f"GPU{i}(Allocated)" for i in gpus], *(["CORE(%)"] if core else [])]]
    for r in _pod_rows(state.pods):
        cells = [
            r.name + (RESERVED_MARK if r.reserved else ""),
            r.namespace,
            *[str(_gib_up(r.memory.get(i, 0))) for i in gpus],
        ]
        if core:
            cores = [str(r.core[i]) for i in gpus if r.core.get(i)]
            cells.append(",".join(cores) or "-")
        rows.append(cells)
    allocated, total = _node_totals(state)
    # ACK writes its totals into the pods' table, so they line up with it.
    rows.append(["Allocated :", f"{allocated} ({_percent(allocated, total)}%)"])
    rows.append(["Total :", str(total)])
    if state.other_instances:
        rows.append(["Not pods :", f"{state.other_instances} instances (in Allocated)"])
    sick = [f"GPU{g.index}{UNHEALTHY_MARK}: {g.health_reason or 'unhealthy'}" for g in state.gpus if not g.healthy]
    return lines + _ragged_table(rows) + [f"Unhealthy: {s}" for s in sick] + [RULE]


def _ragged_table(rows: list[list[str]]) -> list[str]:
    """_table for rows of different lengths (the totals rows have two cells)."""
    width = max(len(r) for r in rows)
    return [line.rstrip() for line in _table([r + [""] * (width - len(r)) for r in rows])]


def details(view: ClusterView) -> str:
    """`kubectl inspect cgpu -d`: every node with its pods, then the cluster."""
    lines: list[str] = []
    for entry in view.nodes:
        lines += ["", *_node_details(entry)]
    allocated, total = _cluster_totals(view)
    lines += ["", f"Allocated/Total GPU Memory In Cluster:  {allocated}/{total} ({_percent(allocated, total)}%)"]
    return "\n".join(lines[1:]) + "\n"


def as_json(view: ClusterView) -> str:
    return json.dumps(view_to_json(view), indent=2) + "\n"


# ---- sources ---------------------------------------------------------------------------


def _parse(body: bytes, where: str) -> ClusterView:
    try:
        return view_from_json(json.loads(body))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InspectError(f"{where} did not answer with a cgpu cluster view: {str(e)[:200]}") from e


def from_extender(url: str, timeout: float = DEFAULT_TIMEOUT) -> ClusterView:
    """cgpu-scheduler's GET /inspect at `url` (its base: http://HOST:PORT)."""
    target = url.rstrip("/") + "/inspect"
    if not target.startswith(("http://", "https://")):
        raise UsageError(f"--extender {url!r}: give a URL, e.g. http://127.0.0.1:12345")
    try:
        with urllib.request.urlopen(target, timeout=timeout) as answer:
            body = answer.read(MAX_VIEW_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise InspectError(f"cgpu-scheduler at {target} answered {e.code} {e.reason}") from e
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise InspectError(f"cannot reach cgpu-scheduler at {target}: {reason}") from e
    if len(body) > MAX_VIEW_BYTES:
        raise InspectError(f"cgpu-scheduler at {target} sent more than {MAX_VIEW_BYTES >> 20} MiB")
    return _parse(body, f"cgpu-scheduler at {target}")


def from_nodes(nodes: Sequence[tuple[str, str]], tls: TlsFiles | None, timeout: float = DEFAULT_TIMEOUT) -> ClusterView:
    """Each node's GetNode, all at once; a node that does not answer is
    listed with its reason."""
    from cgpud.extender.client import get_node  # grpc is needed on this path only

    def one(node: tuple[str, str]) -> NodeEntry:
        name, address = node
        try:
            return NodeEntry(name, address, True, "", get_node(address, tls, timeout))
        except Exception as e:  # any failure of one node is that node's reason, not the command's
            return NodeEntry(name, address, False, _one_line(e))

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(nodes)))) as pool:
        return ClusterView(tuple(pool.map(one, nodes)))


def _one_line(e: Exception) -> str:
    details = getattr(e, "details", None)
    text = details() if callable(details) else str(e)
    return " ".join(str(text or type(e).__name__).split())[:300]


def kubeconfig_path(flag: str | None) -> Path | None:
    """What kubectl would use: --kubeconfig, else the first file of
    $KUBECONFIG, else ~/.kube/config if it exists; None: in-cluster."""
    if flag:
        return Path(flag)
    for part in os.environ.get("KUBECONFIG", "").split(os.pathsep):
        if part and Path(part).is_file():
            return Path(part)
    home = Path.home() / ".kube" / "config"
    return home if home.is_file() else None


def from_service_proxy(
    kubeconfig: Path | None, namespace: str, service: str, timeout: float = DEFAULT_TIMEOUT
) -> ClusterView:
    """GET /inspect of the cgpu-scheduler Service through the API server."""
    from cgpud.kube.apiserver import ApiServerError, client_from
    from cgpud.kube.rest import RestError

    where = f"service {namespace}/{service} (port https, else http) through the API server"
    try:
        api = client_from(kubeconfig, timeout)
    except ApiServerError as e:
        raise InspectError(f"{e}; or give --extender URL or --nodes FILE") from e
    proxy = "/api/v1/namespaces/{namespace}/services/{name}/proxy/inspect"
    try:
        try:  # deploy/cgpu-scheduler.yaml serves HTTPS on a port named https
            body = api.fetch(proxy, {"namespace": namespace, "name": f"https:{service}:https"})
        except RestError as e:
            if e.status not in (404, 503):
                raise
            body = api.fetch(proxy, {"namespace": namespace, "name": f"{service}:http"})
    except RestError as e:
        if e.status == 0:
            raise InspectError(f"cannot reach the API server for {where}: {e.reason}") from e
        raise InspectError(f"cannot read the cluster view from {where}: {e.status} {e.reason}") from e
    finally:
        api.close()
    return _parse(body, where)


# ---- command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="GPU memory allocated and total, per node and per GPU, "
        "from cgpu-scheduler's view of the cluster (or each node's cgpud).",
    )
    p.add_argument("-d", "--details", action="store_true", help="every node with its pods")
    p.add_argument("-o", "--output", choices=["json"], help="the view as JSON (cgpu-scheduler's GET /inspect)")
    p.add_argument("--extender", metavar="URL", help="cgpu-scheduler's address, e.g. http://127.0.0.1:12345")
    p.add_argument("--nodes", metavar="FILE", help="ask each node's cgpud (lines 'NAME HOST:PORT')")
    p.add_argument("--tls-cert", metavar="FILE", help="client certificate for the nodes' Capacity API (--nodes)")
    p.add_argument("--tls-key", metavar="FILE", help="its key")
    p.add_argument("--tls-ca", metavar="FILE", help="CA that signed the nodes' certificates")
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig for the API server (default as kubectl)")
    p.add_argument("--namespace", "-n", default=DEFAULT_NAMESPACE, help="cgpu-scheduler's namespace")
    p.add_argument("--service", default=DEFAULT_SERVICE, help="cgpu-scheduler's Service")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for an answer")
    return p


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise UsageError("--tls-cert, --tls-key and --tls-ca go together")
    from cgpud.extender.client import TlsFiles

    return TlsFiles(cert=Path(args.tls_cert), key=Path(args.tls_key), ca=Path(args.tls_ca))


def load_view(args: argparse.Namespace) -> ClusterView:
    if args.extender and args.nodes:
        raise UsageError("give --extender or --nodes, not both")
    if args.extender:
        return from_extender(args.extender, args.timeout)
    if args.nodes:
        from cgpud.extender.watch import read_node_file  # cgpu-scheduler's own reader: one grammar

        tls = _tls(args)
        return from_nodes(list(read_node_file(Path(args.nodes)).items()), tls, args.timeout)
    return from_service_proxy(kubeconfig_path(args.kubeconfig), args.namespace, args.service, args.timeout)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cgpu"]:  # run by hand as `kubectl-inspect-cgpu cgpu ...`
        argv = argv[1:]
    args = _parser().parse_args(argv)
    return run_command(PROG, lambda: _show(args))


def _show(args: argparse.Namespace) -> int:
    view = load_view(args)
    if args.output == "json":
        text = as_json(view)
    else:
        text = details(view) if args.details else summary(view)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
