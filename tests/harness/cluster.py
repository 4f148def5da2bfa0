"""Several cgpu nodes on one machine, for the cluster side's tests and the
bind benchmark: each node is a real cgpud process (orchestrator kubernetes)
in a network namespace of its own, reached over a veth pair the harness
creates, with its own simulated GPUs, state, device-plugin directory (this
harness plays its kubelet: Registration, ListAndWatch, GetPreferredAllocation,
Allocate, the pod-resources List) and one fake API server for them all.

    with Cluster(nodes=8) as cluster:                 # (root; PYTHONPATH = the repository)
        extender = cluster.start_extender()           # cgpu-scheduler, a real process
        cluster.wait_connected(extender)
        cluster.api.state.add_pod(pod := share_pod("p", 4))
        outcome, _ = schedule(extender.url, pod, cluster.names)      # kube-scheduler's part
        cluster.allocate(cluster.index(outcome.node), "default", "p")  # the kubelet's part

Addresses: node i has 10.X.i.2 (its Capacity API on CAPACITY_PORT), the host
side of its veth 10.X.i.1 (where it reaches the API server, which listens on
all addresses); X is chosen per run among second octets no address or route
of the host uses. Names carry
the creating process id, so a later run sweeps what a killed one left
(sweep_leftovers). Needs root (ip netns, cgpud).

Processes enter only the network namespace (nsenter --net), not a mount
namespace of their own as `ip netns exec` would give them: cgpud's instance
tmpfs mounts must outlive a kill -9 of cgpud, as they do on a real node."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cgpud.api.cgpu.v1 import capacity_pb2 as cap
from cgpud.api.cgpu.v1 import capacity_pb2_grpc as cap_grpc
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2 as dp
from cgpud.api.k8s.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from cgpud.api.k8s.podresources.v1 import api_pb2_grpc as pr_grpc
from cgpud.kube.model import LABEL_MODE, LABEL_PLACEMENT, Resource
from cgpud.native import native_dir
from tests.harness.sim import write_sim_config
from tests.harness.daemon import BIN, Daemon, make_daemon
from tests.harness.api_server import ApiServerProcess, ApiState, node_json
from tests.harness.kubelet_pods import KubeletPods
from tests.harness.kubelet import Kubelet
from tests.harness.net import free_port
from tests.harness.teardown import StartOrClose, terminate
from tests.harness.tls import Pki, make_pki
from tests.harness.wait import until

CAPACITY_PORT = 9455
NETNS_PREFIX = "cgpuc-"  # cgpuc-<tag>-<i>; tag = <pid hex><2 random hex>
LINK_PREFIX = "cc"  # host side cc<tag>h<i>, node side cc<tag>n<i> (15 bytes at most)
ROOT_PREFIX = "cgc-"  # the run's directory: /tmp/cgc-<tag>-<random>
TOOLS = {"ip": "iproute2", "nsenter": "util-linux", "openssl": "openssl"}  # tool -> the package that has it
WAIT = 30.0  # seconds a node may take to start, register, answer
SHARED = (Resource.GPU_MEM, Resource.GPU_CORE, Resource.GPU_COUNT)  # what the kubelet allocates for a share


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=30)
    if check and out.returncode != 0:  # with what the command said: CalledProcessError's text leaves it out
        raise AssertionError(f"$ {' '.join(args)}: exit {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _pid_alive(pid: int) -> bool:
    """A process that runs (a zombie, killed and not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def new_tag() -> str:
    """A cluster's tag: this process's id and two hex digits no cluster of it
    still uses (its root directory or a namespace is there). A random pick
    alone once gave two clusters of one xdist worker the same tag: "ip netns
    add ...: File exists"."""
    pid = f"{os.getpid():x}"
    netns = Path("/run/netns")
    used = {d.name[len(ROOT_PREFIX) + len(pid) :][:2] for d in Path("/tmp").glob(f"{ROOT_PREFIX}{pid}??-*")}
    if netns.is_dir():
        used |= {n.name[len(NETNS_PREFIX) + len(pid) :][:2] for n in netns.glob(f"{NETNS_PREFIX}{pid}??-*")}
    free = [f"{b:02x}" for b in range(256) if f"{b:02x}" not in used]
    if not free:
        raise RuntimeError(f"all 256 cluster tags of process {pid} are in use")
    return pid + secrets.choice(free)


def _tag_pid(tag: str) -> int | None:
    """The creating process id in a tag (all but its last two hex digits)."""
    try:
        return int(tag[:-2], 16) if len(tag) > 2 else None
    except ValueError:
        return None


def sweep_leftovers() -> list[str]:
    """Removes the namespaces (and their processes), links and directories
    an earlier run left when it was killed: those whose creating process is
    gone."""
    removed = []
    names = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    for name in names:
        m = re.fullmatch(rf"{NETNS_PREFIX}([0-9a-f]+)-\d+", name)
        pid = _tag_pid(m.group(1)) if m else None
        if pid is None or _pid_alive(pid):
            continue
        for text in _run("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(text), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass
        _run("ip", "netns", "del", name, check=False)
        removed.append(name)
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():
        m = re.match(rf"\d+: ({LINK_PREFIX}([0-9a-f]+)[hn]\d+)[@:]", line)
        pid = _tag_pid(m.group(2)) if m else None
        if m and pid is not None and not _pid_alive(pid):
            _run("ip", "link", "del", m.group(1), check=False)
            removed.append(m.group(1))
    for directory in Path("/tmp").glob(f"{ROOT_PREFIX}*"):
        m = re.fullmatch(rf"{ROOT_PREFIX}([0-9a-f]+)-.*", directory.name)
        pid = _tag_pid(m.group(1)) if m else None
        if pid is not None and not _pid_alive(pid):
            _unmount_regions(directory)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(str(directory))
    return removed


def _unmount_regions(root: Path) -> None:
    """cgpud keeps its instances' tmpfs mounts after it stops, as on a
    real node; the harness takes its nodes' away with them."""
    from tests.harness.sim import region_mounts as _region_mounts

    mounts = _region_mounts(root)
    if mounts:
        from cgpud._region import lib

        for point in sorted(mounts, reverse=True):
            lib.cgpu_region_unmount(point.encode())


def free_second_octet() -> int:
    """X for 10.X.0.0/16: one no address or route of the host touches."""
    used = set()
    text = _run("ip", "-o", "-4", "addr", "show").stdout + _run("ip", "-4", "route", "show", "table", "all").stdout
    for m in re.finditer(r"\b10\.(\d+)\.", text):
        used.add(int(m.group(1)))
    if re.search(r"\b10\.0\.0\.0/8\b", text):
        raise RuntimeError("the host routes all of 10.0.0.0/8; no room for the test nodes' addresses")
    free = [x for x in range(100, 250) if x not in used]
    if not free:
        raise RuntimeError("no free 10.X.0.0/16 for the test nodes")
    return random.choice(free)


def node_network(stack: ExitStack, tag: str, i: int, host_ip: str, ip: str) -> str:
    """Node i's network namespace, reached over a veth pair: `ip` inside,
    `host_ip` on the host's side (a /30). Both go when `stack` closes.
    Returns the namespace's name."""
    netns = f"{NETNS_PREFIX}{tag}-{i}"
    host_link, node_link = f"{LINK_PREFIX}{tag}h{i}", f"{LINK_PREFIX}{tag}n{i}"
    _run("ip", "netns", "add", netns)
    stack.callback(_run, "ip", "netns", "del", netns, check=False)
    _run("ip", "link", "add", host_link, "type", "veth", "peer", "name", node_link)
    stack.callback(_run, "ip", "link", "del", host_link, check=False)  # gone with the netns anyway
    _run("ip", "link", "set", node_link, "netns", netns)
    _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_link)
    _run("ip", "link", "set", host_link, "up")
    _run("ip", "-n", netns, "addr", "add", f"{ip}/30", "dev", node_link)
    _run("ip", "-n", netns, "link", "set", node_link, "up")
    _run("ip", "-n", netns, "link", "set", "lo", "up")
    return netns


@dataclass
class NodeDaemon(Daemon):
    """cgpud started inside a network namespace."""

    netns: str = ""

    def launch(self) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.netns}", "--", str(BIN / "cgpud"), *self.args],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def wait_ready(self, timeout: float = WAIT) -> None:
        """Until cgpud says READY=1; at once when it exited instead."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.wait_for(b"READY=1", timeout=0.5)
                return
            except AssertionError:
                if self.proc is not None and self.proc.poll() is not None:
                    raise AssertionError(
                        f"cgpud in {self.netns} exited {self.proc.returncode}; its log ends: "
                        f"{self.log.read_text()[-4000:]}"
                    ) from None
                if time.monotonic() > deadline:
                    raise


@dataclass
class Node:
    index: int
    name: str
    netns: str
    host_ip: str  # the host's side of the veth
    ip: str  # the node's address
    directory: Path
    daemon: NodeDaemon
    kubelet: Kubelet
    pods: KubeletPods
    endpoints: dict[str, str] = field(default_factory=dict)  # resource -> plugin socket name
    used: dict[str, set[str]] = field(default_factory=dict)  # device IDs the kubelet handed out, per resource
    held: dict[tuple[str, str], list[tuple[str, list[str]]]] = field(default_factory=dict)  # pod -> (resource, IDs)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one admission at a time, as the kubelet

    @property
    def capacity_address(self) -> str:
        return f"{self.ip}:{CAPACITY_PORT}"


@dataclass
class Extender:
    """cgpu-scheduler as a process."""

    url: str
    proc: subprocess.Popen[str]
    log: Path
    context: ssl.SSLContext | None = None  # over HTTPS: kube-scheduler's client certificate

    def post(self, verb: str, body: Any, timeout: float = 10.0) -> tuple[int, Any]:
        return post_json(f"{self.url}/{verb}", body, timeout, self.context)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout, context=self.context) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, _json_or_text(e.read())

    def stop(self) -> None:
        terminate(self.proc, timeout=10)


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")


def post_json(url: str, body: Any, timeout: float = 10.0, context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, _json_or_text(e.read())


class Cluster(StartOrClose):
    """N nodes, one API server; a context manager that removes everything
    it made however it ends. `mode`: the nodes' ack.node.gpu.schedule."""

    def __init__(
        self,
        nodes: int = 8,
        *,
        gpus: int = 2,
        gpu_memory: str = "16GiB",
        mode: str = "cgpu",
        placement: str | None = None,
        tls: bool = True,
        capacity: bool = True,
        sweep_interval: float = 1.0,
        daemon_args: Sequence[str] = (),
    ) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError("1..250 nodes")
        self.count = nodes
        self.gpus = gpus
        self.gpu_memory = gpu_memory
        self.mode = mode
        self.placement = placement
        self.tls = tls and capacity
        self.capacity = capacity
        # cgpud's sweep (2 s by default) also asks the API server about each
        # reservation's pod; every node asks the one API server of the test
        self.daemon_args = ("--sweep-interval", str(sweep_interval), *daemon_args)
        self.tag = new_tag()
        self.nodes: list[Node] = []
        self.api: ApiServerProcess | None = None
        self.pki: Any = None  # tests.harness.tls.Pki when tls
        # short (unix socket paths); the tag lets a later run sweep it
        self.root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{self.tag}-", dir="/tmp"))
        self.octet = 0
        self._stack = ExitStack()
        self._extenders: list[Extender] = []

    # ---- life ----------------------------------------------------------------------------

    def _start(self) -> None:
        missing = [tool for tool, package in TOOLS.items() if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(
                f"the multi-node harness needs {', '.join(missing)} (Debian: {', '.join(TOOLS[t] for t in missing)})"
            )
        sweep_leftovers()
        self.octet = free_second_octet()
        self.api = ApiServerProcess(ApiState(), host="0.0.0.0").start()
        self._stack.callback(self.api.stop)
        if self.tls:
            self.pki = make_pki(self.root / "pki", server_ips=[self.node_ip(i) for i in range(self.count)])
        for i in range(self.count):
            self.nodes.append(self._make_node(i))
        self._stack.callback(self._stop_all)
        for node in self.nodes:  # start them all, then wait: they start side by side
            node.daemon.launch()
        for node in self.nodes:
            node.daemon.wait_ready()
            self._take_registrations(node)

    def node_ip(self, i: int) -> str:
        return f"10.{self.octet}.{i}.2"

    def _make_node(self, i: int) -> Node:
        assert self.api is not None
        name = f"node-{i}"
        host_ip, ip = f"10.{self.octet}.{i}.1", self.node_ip(i)
        netns = node_network(self._stack, self.tag, i, host_ip, ip)

        directory = self.root / f"n{i}"
        directory.mkdir()
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = str(native_dir() / "sim")
        env["CGPU_SIM_CONFIG"] = str(write_sim_config(directory / "sim.conf", gpus=self.gpus, mem=self.gpu_memory))
        env["CGPU_SIM_STATE"] = str(directory / "sim.state")
        plugins = directory / "dp"
        plugins.mkdir()
        kubelet = Kubelet(plugins).start()
        self._stack.callback(kubelet.stop)
        lister, pod_resources = KubeletPods(), directory / "pod-resources.sock"  # in the run's directory: swept
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(lister, server)
        assert server.add_insecure_port(f"unix:{pod_resources}") != 0
        server.start()
        self._stack.callback(lambda: server.stop(None).wait(5))
        labels = {LABEL_MODE: self.mode}
        if self.placement:
            labels[LABEL_PLACEMENT] = self.placement
        with self.api.state.lock:
            self.api.state.nodes[name] = node_json(name, labels)
        kubeconfig = self.api.kubeconfig(directory / "kubeconfig", address=host_ip)
        args = [
            "--orchestrator",
            "kubernetes",
            "--node-name",
            name,
            "--kubeconfig",
            str(kubeconfig),
            "--device-plugin-dir",
            str(plugins),
            "--pod-resources-socket",
            str(pod_resources),
            "--cdi-dir",
            str(directory / "cdi"),
        ]
        if self.capacity:
            args += ["--capacity-listen", f"{ip}:{CAPACITY_PORT}"]
        if self.capacity and self.pki is None:
            args += ["--capacity-insecure", "true"]  # plaintext across the veth: tls=False asked for it
        if self.pki is not None:
            cert, key = self.pki.node_cert(name, ips=[ip])  # its own: the extender checks it names the Node
            args += [
                "--capacity-tls-cert",
                str(cert),
                "--capacity-tls-key",
                str(key),
                "--capacity-tls-ca",
                str(self.pki.ca),
            ]
        base = make_daemon(directory, env, *args, *self.daemon_args)
        daemon = NodeDaemon(base.socket, base.state, base.env, base.notify, base.args, netns=netns)
        self._stack.callback(base.notify.close)
        self._stack.callback(self._stop_daemon, daemon)
        return Node(i, name, netns, host_ip, ip, directory, daemon, kubelet, lister)

    @staticmethod
    def _stop_daemon(daemon: NodeDaemon) -> None:
        if daemon.proc is not None:
            terminate(daemon.proc)

    def _stop_all(self) -> None:
        """Every node at once: they stop side by side."""
        terminate(*(n.daemon.proc for n in self.nodes if n.daemon.proc is not None))

    def _take_registrations(self, node: Node) -> None:
        """The plugin registers each resource with the kubelet (again after a
        restart); the harness keeps the latest endpoint of each."""
        wanted = {r.value for r in Resource}
        got: dict[str, str] = {}
        deadline = time.monotonic() + WAIT
        while set(got) != wanted:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{node.name}: registered only {sorted(got)}; log: {self.log_tail(node.index)}")
            try:
                r = node.kubelet.registered.get(timeout=left)
            except Exception:
                continue
            got[r.resource_name] = r.endpoint
        node.endpoints = got

    def close(self) -> None:
        for extender in self._extenders:
            extender.stop()
        self._extenders.clear()
        try:
            self._stack.close()  # daemons, kubelets, pod-resources servers, namespaces, the API server
        finally:
            _unmount_regions(self.root)
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- nodes ---------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def index(self, name: str) -> int:
        return next(n.index for n in self.nodes if n.name == name)

    def addresses(self) -> dict[str, str]:
        """Node name -> its Capacity address (HOST:PORT)."""
        return {n.name: n.capacity_address for n in self.nodes}

    def node_file(self, path: Path | None = None) -> Path:
        """cgpu-scheduler's --nodes file."""
        path = path or self.root / "nodes"
        path.write_text("# name capacity address\n" + "".join(f"{n.name} {n.capacity_address}\n" for n in self.nodes))
        return path

    def kill(self, i: int) -> None:
        """kill -9 node i's cgpud."""
        self.nodes[i].daemon.kill()

    def restart(self, i: int) -> None:
        """Starts node i's cgpud again (after kill or stop) and waits until
        its device plugin registered again."""
        node = self.nodes[i]
        if node.daemon.proc is not None and node.daemon.proc.poll() is None:
            self._stop_daemon(node.daemon)
        node.daemon.start()
        self._take_registrations(node)

    def alive(self, i: int) -> bool:
        proc = self.nodes[i].daemon.proc
        return proc is not None and proc.poll() is None

    def log_tail(self, i: int, size: int = 4000) -> str:
        log = self.nodes[i].daemon.log
        return log.read_text()[-size:] if log.exists() else ""

    def cgpuctl(self, i: int, *args: str) -> subprocess.CompletedProcess[str]:
        return self.nodes[i].daemon.cgpuctl(*args)

    def instances(self, i: int) -> list[dict[str, Any]]:
        out = self.cgpuctl(i, "list", "--output", "json")
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout))

    def capacity_tls(self) -> tuple[Path, Path, Path] | None:
        """(client cert, client key, CA) for a Capacity client, or None."""
        if self.pki is None:
            return None
        return self.pki.client_cert, self.pki.client_key, self.pki.ca

    def capacity_channel(self, i: int, cert: Path | None = None, key: Path | None = None) -> grpc.Channel:
        """A channel to node i's Capacity API across its veth, with the
        harness's client certificate (or the given one)."""
        address = self.nodes[i].capacity_address
        if self.pki is None:
            return grpc.insecure_channel(address)
        cert = cert or self.pki.client_cert
        key = key or self.pki.client_key
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.pki.ca.read_bytes(),
            private_key=key.read_bytes(),
            certificate_chain=cert.read_bytes(),
        )
        return grpc.secure_channel(address, credentials)

    def get_node(self, i: int, timeout: float = 10.0) -> cap.NodeView:
        """Node i's own view (cgpu.v1.Capacity/GetNode)."""
        with self.capacity_channel(i) as channel:
            return cap_grpc.CapacityStub(channel).GetNode(cap.GetNodeRequest(), timeout=timeout)

    # ---- the extender --------------------------------------------------------------------

    def start_extender(
        self, *args: str, with_api: bool = True, node_file: bool = True, serving: Pki | None = None
    ) -> Extender:
        """cgpu-scheduler on 127.0.0.1, watching every node: from the node
        file, or (node_file False) from the Nodes' capacity-address
        annotations through the API server. Bound to the fake API server
        unless with_api is False (standalone). `serving`: over HTTPS with
        that PKI's server certificate, its CA as the client CA (as
        deploy/ runs it), called with its client certificate."""
        assert self.api is not None
        assert with_api or node_file, "without a node file the extender finds nodes through the API server"
        port = free_port()
        command = [str(BIN / "cgpu-scheduler"), "--listen", f"127.0.0.1:{port}"]
        if node_file:
            command += ["--nodes", str(self.node_file())]
        if with_api:
            command += ["--kubeconfig", str(self.api.kubeconfig(self.root / "kubeconfig"))]
        tls = self.capacity_tls()
        if tls is not None:
            command += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1]), "--tls-ca", str(tls[2])]
        context = None
        if serving is not None:
            command += ["--serve-cert", str(serving.server_cert), "--serve-key", str(serving.server_key)]
            command += ["--client-ca", str(serving.ca)]
            context = serving.client_context()
        log = self.root / f"extender-{len(self._extenders)}.log"
        with open(log, "a") as out:
            proc = subprocess.Popen([*command, *args], stdout=subprocess.DEVNULL, stderr=out, text=True)
        scheme = "https" if serving is not None else "http"
        extender = Extender(f"{scheme}://127.0.0.1:{port}", proc, log, context)
        self._extenders.append(extender)

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"cgpu-scheduler exited {proc.returncode}: {log.read_text()[-4000:]}")
            try:
                return extender.get("/healthz", timeout=1.0)[0] == 200
            except OSError:
                return False

        until(
            healthy,
            timeout=WAIT,
            interval=0.05,
            what="cgpu-scheduler to answer /healthz",
            explain=lambda: f"its log ends: {log.read_text()[-4000:]}",
        )
        return extender

    def wait_connected(self, extender: Extender, names: Sequence[str] | None = None, timeout: float = WAIT) -> None:
        """Until the extender's view has a live stream and a view of each node."""
        wanted = set(names if names is not None else self.names)
        nodes: list[dict[str, Any]] = []

        def connected() -> bool:
            nonlocal nodes
            status, view = extender.get("/inspect")
            nodes = view.get("nodes", []) if status == 200 and isinstance(view, dict) else []
            return wanted <= {n["name"] for n in nodes if n.get("connected") and n.get("state")}

        until(
            connected,
            timeout=timeout,
            interval=0.05,
            what=f"the extender to connect to {sorted(wanted)}",
            explain=lambda: f"its nodes: {nodes}",
        )

    # ---- the kubelet ---------------------------------------------------------------------

    def _devices(self, node: Node, resource: str) -> list[str]:
        with grpc.insecure_channel(f"unix:{node.kubelet.directory / node.endpoints[resource]}") as channel:
            stream = dp_grpc.DevicePluginStub(channel).ListAndWatch(dp.Empty(), timeout=WAIT)
            first = next(iter(stream))
            stream.cancel()
        return [d.ID for d in first.devices if d.health == "Healthy"]

    def allocate(self, i: int, namespace: str, name: str) -> list[dp.ContainerAllocateResponse]:
        """What node i's kubelet does to admit a pod bound to it: for each
        container (init containers first) and each GPU-share resource it
        asks for, pick free device IDs (GetPreferredAllocation over the
        healthy ones ListAndWatch lists), Allocate them, then list the pod
        in pod-resources. Returns the memory Allocates' answers in order;
        raises grpc.RpcError as the kubelet would see it.

        An Allocate does not name its pod: cgpud serves it to the oldest
        assumed pod asking that much (gpushare's rule, docs/kubernetes.md),
        so admit a node's pods in the order they were bound, as a kubelet
        does, to get each pod its own instance."""
        assert self.api is not None
        node = self.nodes[i]
        pod = self.api.state.pod(namespace, name)
        bound = pod["spec"].get("nodeName")
        if bound != node.name:
            raise AssertionError(f"pod {namespace}/{name} is bound to {bound!r}, not {node.name}")
        answers = []
        with node.lock:
            for container in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
                limits = container.get("resources", {}).get("limits", {})
                for resource in SHARED:
                    count = int(limits.get(resource.value, 0))
                    if count <= 0:
                        continue
                    ids = self._allocate_one(node, resource.value, count)
                    node.held.setdefault((namespace, name), []).append((resource.value, ids[0]))
                    if resource is Resource.GPU_MEM:
                        answers.append(ids[1])
                        node.pods.hold(namespace, name, container["name"], resource.value, tuple(ids[0]))
        return answers

    def delete_pod(self, namespace: str, name: str) -> None:
        """The pod is deleted: gone from the API server, and its node's
        kubelet (if it admitted it) frees its devices and stops listing it."""
        assert self.api is not None
        bound = self.api.state.pod(namespace, name)["spec"].get("nodeName")
        self.api.state.delete_pod(namespace, name)
        node = next((n for n in self.nodes if n.name == bound), None)
        if node is None:
            return
        with node.lock:
            node.pods.forget(namespace, name)
            for resource, ids in node.held.pop((namespace, name), []):
                node.used.get(resource, set()).difference_update(ids)

    def _allocate_one(self, node: Node, resource: str, count: int) -> tuple[list[str], dp.ContainerAllocateResponse]:
        used = node.used.setdefault(resource, set())
        free = [d for d in self._devices(node, resource) if d not in used]
        path = f"unix:{node.kubelet.directory / node.endpoints[resource]}"
        with grpc.insecure_channel(path) as channel:
            stub = dp_grpc.DevicePluginStub(channel)
            preferred = stub.GetPreferredAllocation(
                dp.PreferredAllocationRequest(
                    container_requests=[
                        dp.ContainerPreferredAllocationRequest(available_deviceIDs=free, allocation_size=count)
                    ]
                ),
                timeout=WAIT,
            )
            ids = list(preferred.container_responses[0].deviceIDs) or free[:count]
            answer = stub.Allocate(
                dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]), timeout=WAIT
            )
        used.update(ids)
        return ids, answer.container_responses[0]


# ---- kube-scheduler's part ---------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One scheduling attempt: the node bound, or why not."""

    node: str | None
    failed: dict[str, str] = field(default_factory=dict)  # the filter's FailedNodes
    error: str = ""  # the extender's Error (filter or bind)
    stage: str = ""  # where it stopped: "filter", "prioritize", "bind", "" when bound


def schedule_once(
    url: str, pod: dict[str, Any], names: Sequence[str], timeout: float = 10.0, rng: random.Random | None = None
) -> Outcome:
    """One scheduling cycle as kube-scheduler runs it against a
    nodeCacheCapable extender: filter (NodeNames) -> prioritize on what
    passed -> the best score (ties broken at random) -> bind."""
    args = {"Pod": pod, "Nodes": None, "NodeNames": list(names)}
    status, result = post_json(f"{url}/filter", args, timeout)
    if status != 200:
        return Outcome(None, error=f"filter: HTTP {status}: {result}", stage="filter")
    failed = dict(result.get("FailedNodes") or {})
    failed.update(result.get("FailedAndUnresolvableNodes") or {})
    if result.get("Error"):
        return Outcome(None, failed, result["Error"], "filter")
    passed = list(result.get("NodeNames") or [])
    if not passed:
        return Outcome(None, failed, "no node fits", "filter")
    status, scores = post_json(f"{url}/prioritize", dict(args, NodeNames=passed), timeout)
    if status != 200 or not isinstance(scores, list):
        return Outcome(None, failed, f"prioritize: HTTP {status}: {scores}", "prioritize")
    by_host = {s["Host"]: s["Score"] for s in scores}
    best = max(by_host.get(n, 0) for n in passed)
    node = (rng or random).choice([n for n in passed if by_host.get(n, 0) == best])
    meta = pod["metadata"]
    status, bound = post_json(
        f"{url}/bind",
        {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node},
        timeout,
    )
    if status != 200 or (isinstance(bound, dict) and bound.get("Error")):
        error = bound.get("Error") if isinstance(bound, dict) else f"HTTP {status}: {bound}"
        return Outcome(None, failed, f"bind on {node}: {error}", "bind")
    return Outcome(node, failed)


def schedule(
    url: str,
    pod: dict[str, Any],
    names: Sequence[str],
    *,
    attempts: int = 20,
    backoff: float = 0.05,
    rng: random.Random | None = None,
) -> tuple[Outcome, list[Outcome]]:
    """kube-scheduler's loop for one pod: a failed cycle (nothing fits, or
    the bind failed) puts the pod back in the queue and it is tried again
    after a backoff. Returns the final outcome and the failed attempts."""
    failures: list[Outcome] = []
    for attempt in range(attempts):
        outcome = schedule_once(url, pod, names, rng=rng)
        if outcome.node is not None:
            return outcome, failures
        failures.append(outcome)
        time.sleep(min(backoff * 2**attempt, 1.0))
    return failures[-1], failures[:-1]


def share_pod(name: str, gib: int, *, namespace: str = "default", core: int = 0, count: int = 0) -> dict[str, Any]:
    """An unbound pod asking for a GPU share, as the API server holds it."""
    from tests.harness.api_server import pod_json

    limits: dict[str, Any] = {Resource.GPU_MEM.value: gib}
    if core:
        limits[Resource.GPU_CORE.value] = core
    if count:
        limits[Resource.GPU_COUNT.value] = count
    pod = pod_json(name, "", namespace=namespace, containers={"main": limits})
    pod["spec"].pop("nodeName")
    return pod
