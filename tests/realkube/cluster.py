"""A real Kubernetes cluster on one machine, for the real-cluster tests:
etcd, kube-apiserver, kube-controller-manager and kube-scheduler (with
cgpu-scheduler as its extender, configured by deploy/kube-scheduler-config.yaml)
on the host; each node is a network namespace with its own containerd 2,
kubelet and cgpud (on the simulated GPUs), reached over a veth pair. All
of them are the real programs (tests/realkube/build.py builds them); every
connection is TLS with certificates this harness issues.

    with RealCluster(binaries, nodes=1) as cluster:   # root
        cluster.kubectl("apply", "-f", "pod.yaml")

Addresses: node i is 10.X.i.2 in its namespace, the host's side of its veth
10.X.i.1; the API server listens on the host's addresses, so each node
reaches it at its own 10.X.i.1. (A kubelet refuses a loopback node IP.)
Names follow tests/harness/cluster.py's, so its sweep_leftovers removes what a
killed run left."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml

from cgpud.cli.sim_topology import placement
from cgpud.native import native_dir, native_path
from tests.harness.cluster import ROOT_PREFIX, _pid_alive, _tag_pid, _unmount_regions, free_port, free_second_octet
from tests.harness.cluster import new_tag
from tests.harness.cluster import node_network, sweep_leftovers
from tests.harness.sim import write_sim_config
from tests.harness.daemon import BIN
from tests.harness.oci import build_rootfs
from tests.realkube.build import KubeBinaries
from tests.realkube.image import pause_root, write_archive
from tests.harness.teardown import StartOrClose, terminate
from tests.harness.tls import Pki, ca, leaf, make_pki
from tests.harness.nvml_total import build_nvml_total
from tests.harness.wait import until

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
WORKLOAD_IMAGE = "cgpu.test/workload:1"  # busybox, cgpu-burn, the driver libraries (tests/harness/oci.py)
PAUSE_IMAGE = "cgpu.test/pause:1"
CGPUD_IMAGE = "cgpu.test/cgpud:1"  # busybox; cgpud_daemonset mounts the host's installation into it
CAPACITY_PORT = 9455
EXTENDER_PORT = 12345  # deploy/cgpu-scheduler.yaml's --listen
CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
WAIT = 90.0  # seconds for a component to come up on a loaded 2-core machine


class ClusterError(AssertionError):
    pass


def _run(
    *args: str, check: bool = True, timeout: float = 60, env: dict[str, str] | None = None, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env, input=input)
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(args)} exited {done.returncode}: {done.stderr[-3000:]}")
    return done


def _remove_if_empty(directory: Path) -> None:
    """Removes the directory and its parents this harness made, if empty."""
    for d in (directory, *directory.parents):
        try:
            d.rmdir()
        except OSError:
            return


def _remove_cgroup(group: Path) -> None:
    for child in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            child.rmdir()
        except OSError:
            pass
    try:
        group.rmdir()
    except OSError:
        pass


@dataclass
class Process:
    """One component: its command, its log, in the host's or a node's network."""

    name: str
    command: list[str]
    log: Path
    netns: str | None = None
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        prefix = ["nsenter", f"--net=/run/netns/{self.netns}", "--"] if self.netns else []
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*prefix, *self.command], stdout=log, stderr=log, env=self.env, start_new_session=True
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout=timeout)

    def tail(self, size: int = 3000) -> str:
        try:
            return self.log.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ClusterError(f"{self.name} exited {self.proc.returncode}; its log ends:\n{self.tail()}")


@dataclass(frozen=True)
class ClusterPki:
    """The cluster's CA and the certificates of its parts (Kubernetes reads a
    client's user from CN and its groups from O)."""

    dir: Path
    ca: Path
    ca_key: Path
    sa_key: Path  # service account token signing
    sa_pub: Path

    @classmethod
    def make(cls, dir: Path) -> ClusterPki:
        dir.mkdir(parents=True)
        cert, key = ca(dir, "kube-ca")
        sa_key, sa_pub = dir / "sa.key", dir / "sa.pub"
        _run("openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(sa_key))
        _run("openssl", "pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
        return cls(dir, cert, key, sa_key, sa_pub)

    def client(self, name: str, user: str, groups: Sequence[str] = ()) -> tuple[Path, Path]:
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
        return leaf(self.dir, name, (self.ca, self.ca_key), "clientAuth", f"DNS:{name}", subject)

    def server(self, name: str, ips: Sequence[str], names: Sequence[str] = ()) -> tuple[Path, Path]:
        san = ",".join([*(f"IP:{ip}" for ip in ips), *(f"DNS:{n}" for n in names)])
        return leaf(self.dir, name, (self.ca, self.ca_key), "serverAuth", san)


def kubeconfig(
    path: Path, server: str, ca_file: Path, *, cert: tuple[Path, Path] | None = None, token: str | None = None
) -> Path:
    user: dict[str, Any] = {}
    if cert:
        user = {"client-certificate": str(cert[0]), "client-key": str(cert[1])}
    if token:
        user = {"token": token}
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return path


@dataclass
class RealNode:
    index: int
    name: str
    netns: str
    host_ip: str
    ip: str
    dir: Path
    sim_env: dict[str, str]
    containerd: Process
    kubelet: Process
    cgpud: Process | None = None

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd.sock"

    @property
    def kubelet_dir(self) -> Path:
        return self.dir / "kubelet"

    @property
    def device_plugin_dir(self) -> Path:
        return self.dir / "device-plugins"

    @property
    def cdi_dir(self) -> Path:
        return self.dir / "cdi"

    @property
    def sim_dir(self) -> Path:
        return self.dir.parent / "sim" / self.name

    @property
    def cgpud_dir(self) -> Path:
        return self.dir / "cgpud"

    @property
    def cgpud_socket(self) -> Path:
        return self.cgpud_dir / "run" / "cgpud.sock"

    def cgpuctl(self, *args: str, socket: Path | None = None) -> subprocess.CompletedProcess[str]:
        return _run(
            str(BIN / "cgpuctl"), "--socket", str(socket or self.cgpud_socket), *args, check=False, env=self.sim_env
        )


class RealCluster(StartOrClose):
    """A context manager that removes everything it made however it ends."""

    def __init__(
        self, binaries: KubeBinaries, nodes: int = 1, *, gpus: int = 1, gpu_memory: str = "16GiB", topology: str = ""
    ) -> None:
        self.bin = binaries
        self.count = nodes
        self.gpus = gpus
        # Each node's GPUs placed as a machine of cgpud/cli/sim_topology.py ("": no PCIe tree, no links).
        self.placements = placement(topology, gpus) if topology else ()
        self.gpu_memory = gpu_memory
        self.tag = new_tag()
        self.root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{self.tag}-", dir="/tmp"))
        self.dev_root = self.root / "driver"  # cgpud's dev_root: the driver's device nodes, as a driver container's
        self.octet = 0
        self.nodes: list[RealNode] = []
        self.control: dict[str, Process] = {}
        self.extender_url = ""
        self._stack = ExitStack()
        self._stack.callback(shutil.rmtree, self.root, True)  # last: after every node is cleaned

    # ---- life ----------------------------------------------------------------------------

    def close(self) -> None:
        self._stack.close()

    def _start(self) -> None:
        self._sweep()
        sweep_leftovers()
        self.octet = free_second_octet()
        self._route_between_nodes()
        self._driver_device_nodes()
        self.pki = ClusterPki.make(self.root / "pki")
        self.capacity_pki: Pki = make_pki(self.root / "capacity-pki")  # the Capacity API's and the extender's
        self.images = self._images()
        self._start_control_plane()
        self.apply_deploy()
        self.extender_url = f"https://{self.node_ip(0)}:{EXTENDER_PORT}"  # where its pod listens (hostNetwork)
        self._start_scheduler()
        for i in range(self.count):
            self.nodes.append(self._make_node(i))
        for node in self.nodes:
            self.wait_node_ready(node)
        self._start_extender()

    def _route_between_nodes(self) -> None:
        """Nodes reach each other through the host (cgpu-scheduler, in
        node-0's network, dials every node's cgpud): forwarding on, and
        accepted for this cluster's addresses, both undone at the end."""
        forward = Path("/proc/sys/net/ipv4/ip_forward")
        before = forward.read_text()
        forward.write_text("1\n")
        self._stack.callback(forward.write_text, before)
        if shutil.which("iptables"):
            rule = ["FORWARD", "-s", f"10.{self.octet}.0.0/16", "-d", f"10.{self.octet}.0.0/16", "-j", "ACCEPT"]
            if _run("iptables", "-I", *rule, check=False).returncode == 0:
                self._stack.callback(_run, "iptables", "-D", *rule, check=False)

    def _driver_device_nodes(self) -> None:
        """What the NVIDIA driver makes, /dev/nvidiactl, /dev/nvidia-uvm(-tools)
        and /dev/nvidia<minor> for the simulated GPUs' minor numbers, as
        character devices with the driver's major (195; uvm's is dynamic),
        under the cluster's own dev_root as a driver container makes them:
        the host's /dev, which every other test's cgpud reads, is left
        alone. containerd copies them into containers as cgpud's answers
        name them; nothing opens them."""
        dev = self.dev_root / "dev"
        dev.mkdir(parents=True)
        minors = {"nvidiactl": 255, "nvidia-uvm": 254, "nvidia-uvm-tools": 253}
        minors.update({f"nvidia{i}": i for i in range(self.gpus)})
        for name, minor in minors.items():
            os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(195, minor))

    @classmethod
    def _sweep(cls) -> None:
        """What a killed run left (its processes, mounts and cgroups), found
        by its node cgroups: those whose creating process is gone.
        tests/harness/cluster.py's sweep then takes its namespaces and directories."""
        pattern = re.compile(rf"/tmp/{ROOT_PREFIX}([0-9a-f]+)-")
        for proc in Path("/proc").iterdir():  # shims and the like whose socket path names a dead run
            try:
                m = (
                    pattern.search((proc / "cmdline").read_bytes().decode(errors="replace"))
                    if proc.name.isdigit()
                    else None
                )
            except OSError:
                continue
            pid = _tag_pid(m.group(1)) if m else None
            if pid is not None and not _pid_alive(pid):
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        memory = Path("/sys/fs/cgroup/memory")
        for group in memory.glob("cgk*n*") if memory.is_dir() else []:
            m = re.fullmatch(r"cgk([0-9a-f]+)n(\d+)", group.name)
            pid = _tag_pid(m.group(1)) if m else None
            if m is None or pid is None or _pid_alive(pid):
                continue
            for root in Path("/tmp").glob(f"{ROOT_PREFIX}{m.group(1)}-*"):
                cls._clean_node(root / f"n{m.group(2)}", group.name)
            cls._clean_node(Path("/nonexistent") / group.name, group.name)

    def _process(
        self,
        name: str,
        command: list[str],
        netns: str | None = None,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> Process:
        process = Process(name, command, log or self.root / f"{name}.log", netns, env).start()
        self._stack.callback(process.stop)
        return process

    def host_ip(self, i: int) -> str:
        return f"10.{self.octet}.{i}.1"

    def node_ip(self, i: int) -> str:
        return f"10.{self.octet}.{i}.2"

    # ---- control plane -------------------------------------------------------------------

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    def _secret(self, name: str, files: dict[str, Path]) -> None:
        """A generic Secret in kube-system, one key per file."""
        self.kubectl(
            "-n",
            "kube-system",
            "create",
            "secret",
            "generic",
            name,
            *(f"--from-file={k}={v}" for k, v in files.items()),
        )

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        return _run(
            "kubectl",
            "--kubeconfig",
            str(kubeconfig or self.admin_kubeconfig),
            *args,
            check=check,
            input=input,
            timeout=timeout,
        )

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def _start_control_plane(self) -> None:
        etcd_port, peer_port, self.api_port = free_port(), free_port(), free_port("0.0.0.0")
        etcd = self._process(
            "etcd",
            [
                str(self.bin["etcd"]),
                "--name",
                "etcd",
                "--data-dir",
                str(self.root / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"etcd=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )

        def etcd_ready() -> bool:
            etcd.check()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        until(etcd_ready, WAIT, interval=0.2, what="etcd ready", explain=etcd.tail)
        host_ips = [self.host_ip(i) for i in range(self.count)]
        serving = self.pki.server(
            "kube-apiserver",
            ["127.0.0.1", "10.96.0.1", *host_ips],
            ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
        )
        kubelet_client = self.pki.client(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"]
        )
        apiserver = self._process(
            "kube-apiserver",
            [
                str(self.bin["kube-apiserver"]),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=0.0.0.0",
                f"--secure-port={self.api_port}",
                f"--advertise-address={host_ips[0]}",
                f"--tls-cert-file={serving[0]}",
                f"--tls-private-key-file={serving[1]}",
                f"--client-ca-file={self.pki.ca}",
                f"--kubelet-client-certificate={kubelet_client[0]}",
                f"--kubelet-client-key={kubelet_client[1]}",
                f"--kubelet-certificate-authority={self.pki.ca}",
                "--kubelet-preferred-address-types=InternalIP",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.pki.sa_pub}",
                f"--service-account-signing-key-file={self.pki.sa_key}",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
            ],
        )
        admin = self.pki.client("admin", "cluster-admin", ["system:masters"])
        kubeconfig(self.admin_kubeconfig, self.api_url("127.0.0.1"), self.pki.ca, cert=admin)

        def api_ready() -> bool:
            apiserver.check()
            return self.kubectl("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0

        until(api_ready, WAIT, interval=0.2, what="kube-apiserver ready", explain=apiserver.tail)
        self.control.update(etcd=etcd, apiserver=apiserver)
        cm = self.pki.client("kube-controller-manager", "system:kube-controller-manager")
        self.control["controller-manager"] = self._process(
            "kube-controller-manager",
            [
                str(self.bin["kube-controller-manager"]),
                "--kubeconfig="
                + str(kubeconfig(self.root / "cm.kubeconfig", self.api_url("127.0.0.1"), self.pki.ca, cert=cm)),
                f"--service-account-private-key-file={self.pki.sa_key}",
                f"--root-ca-file={self.pki.ca}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--secure-port=0",
            ],
        )
        # The default ServiceAccount that pods need is the controller-manager's doing.
        cm_process = self.control["controller-manager"]
        until(
            lambda: cm_process.check() or self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            WAIT,
            interval=0.2,
            what="the default ServiceAccount",
            explain=cm_process.tail,
        )

    @property
    def sim_root(self) -> Path:
        return self.root / "sim"

    def api_url(self, host: str) -> str:
        return f"https://{host}:{self.api_port}"

    def manifests(self, name: str, kinds: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The documents of deploy/<name>, those of `kinds` only if given."""
        docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
        return [d for d in docs if kinds is None or d["kind"] in kinds]

    def apply(self, docs: Sequence[dict[str, Any]]) -> None:
        self.kubectl("apply", "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in docs))

    def apply_deploy(self) -> None:
        """What deploy/ ships for access: cgpud's and cgpu-scheduler's
        accounts and rights, and the admission policy."""
        self.apply(self.manifests("cgpud-rbac.yaml"))
        self.apply(self.manifests("cgpud-admission-policy.yaml"))
        self.apply(
            self.manifests(
                "cgpu-scheduler.yaml", ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
            )
        )

    def token(self, account: str, namespace: str = "kube-system", *bound: str) -> str:
        return self.kubectl("create", "token", account, "-n", namespace, "--duration", "24h", *bound).stdout.strip()

    def _extender_secrets(self) -> None:
        """Step 1 of docs/scheduler.md: cgpu-scheduler's Capacity client
        certificate and its serving certificate with the client CA, as the
        two Secrets deploy/cgpu-scheduler.yaml mounts. The serving
        certificate names node-0's address, where its pod runs."""
        c = self.capacity_pki
        serving = leaf(
            c.dir,
            "cgpu-scheduler-serving",
            (c.ca, c.ca_key),
            "serverAuth",
            f"IP:{self.node_ip(0)},DNS:cgpu-scheduler.kube-system.svc",
        )
        self._secret("cgpu-capacity-client", {"tls.crt": c.client_cert, "tls.key": c.client_key, "ca.crt": c.ca})
        self._secret("cgpu-scheduler-serving", {"tls.crt": serving[0], "tls.key": serving[1], "client-ca.crt": c.ca})

    def extender_manifests(self) -> list[dict[str, Any]]:
        """deploy/cgpu-scheduler.yaml's Deployment, Service and NetworkPolicy
        for this machine. What differs, and why: the image (a busybox image
        running the host's installation, read-only, as cgpud_daemonset);
        the host network on node-0, because the nodes here have no pod
        network (and so kube-scheduler's urlPrefix is node-0's address); the
        API server's address for the Service's (no kube-proxy). The
        NetworkPolicy is applied but not enforced: no CNI plugin here
        enforces policies."""
        docs = self.manifests("cgpu-scheduler.yaml", ["Deployment", "Service", "NetworkPolicy"])
        [deployment] = [d for d in docs if d["kind"] == "Deployment"]
        pod = deployment["spec"]["template"]["spec"]
        pod["hostNetwork"] = True
        pod["nodeSelector"] = {"kubernetes.io/hostname": "node-0"}
        [container] = pod["containers"]
        container["image"], container["imagePullPolicy"] = CGPUD_IMAGE, "Never"
        venv, base = Path(sys.prefix), Path(sys.base_prefix)
        container["env"] = [
            *container.get("env", []),
            {"name": "PATH", "value": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"},
            {"name": "KUBERNETES_SERVICE_HOST", "value": self.host_ip(0)},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.api_port)},
        ]
        pod["volumes"].append({"name": "driver-root", "hostPath": {"path": str(self.dev_root), "type": "Directory"}})
        container["volumeMounts"].append({"name": "driver-root", "mountPath": str(self.dev_root), "readOnly": True})
        for i, path in enumerate(dict.fromkeys([venv, base, REPO, Path("/usr"), native_dir()])):
            pod["volumes"].append({"name": f"host-{i}", "hostPath": {"path": str(path), "type": "Directory"}})
            container["volumeMounts"].append({"name": f"host-{i}", "mountPath": str(path), "readOnly": True})
        return docs

    def _start_extender(self) -> None:
        """cgpu-scheduler as deploy/cgpu-scheduler.yaml runs it, scheduled by
        kube-scheduler like any pod (it asks for no GPU share)."""
        self._extender_secrets()
        self.apply(self.extender_manifests())

        def ready() -> bool:
            done = self.kubectl(
                "-n",
                "kube-system",
                "get",
                "deployment",
                "cgpu-scheduler",
                "-o",
                "jsonpath={.status.readyReplicas}",
                check=False,
            )
            return done.stdout.strip() == "1"

        until(
            ready,
            WAIT,
            interval=0.2,
            what="cgpu-scheduler's Deployment ready",
            explain=lambda: (
                self.kubectl(
                    "-n", "kube-system", "describe", "pods", "-l", "app.kubernetes.io/name=cgpu-scheduler", check=False
                ).stdout[-4000:]
                + self.kubectl("-n", "kube-system", "logs", "deployment/cgpu-scheduler", check=False).stdout[-3000:]
            ),
        )

    def restart_extender(self, *options: str) -> None:
        """cgpu-scheduler's Deployment again with deploy/'s command and
        `options` after it (its strategy, Recreate, stops the old pod first:
        both would listen on node-0's port), until the new one is ready."""
        [deployment] = [d for d in self.extender_manifests() if d["kind"] == "Deployment"]
        command = [*deployment["spec"]["template"]["spec"]["containers"][0]["command"], *options]
        patch = [{"op": "replace", "path": "/spec/template/spec/containers/0/command", "value": command}]
        self.kubectl(
            "-n", "kube-system", "patch", "deployment", "cgpu-scheduler", "--type=json", "-p", json.dumps(patch)
        )
        self.kubectl(
            "-n", "kube-system", "rollout", "status", "deployment/cgpu-scheduler", "--timeout=120s", timeout=130
        )

        def serving() -> bool:
            try:
                return self.extender_inspect()["pick_at_filter"] == ("--pick-at-filter" in options)
            except OSError:
                return False

        until(serving, WAIT, interval=0.2, what="the new cgpu-scheduler answering")

    def scheduler_config(self) -> dict[str, Any]:
        """deploy/kube-scheduler-config.yaml with this cluster's paths and the
        extender's address: nothing else of it is changed."""
        [config] = self.manifests("kube-scheduler-config.yaml")
        client = self.pki.client("kube-scheduler", "system:kube-scheduler")
        config["clientConnection"]["kubeconfig"] = str(
            kubeconfig(self.root / "scheduler.kubeconfig", self.api_url("127.0.0.1"), self.pki.ca, cert=client)
        )
        config["leaderElection"] = {"leaderElect": False}
        c = self.capacity_pki
        for extender in config["extenders"]:  # shares, and whole GPUs on topology nodes
            extender["urlPrefix"] = self.extender_url
            extender["tlsConfig"] = {"certFile": str(c.client_cert), "keyFile": str(c.client_key), "caFile": str(c.ca)}
        return config

    def _start_scheduler(self) -> None:
        path = self.root / "kube-scheduler.yaml"
        path.write_text(yaml.safe_dump(self.scheduler_config()))
        self.control["kube-scheduler"] = self._process(
            "kube-scheduler", [str(self.bin["kube-scheduler"]), f"--config={path}", "--secure-port=0"]
        )

    # ---- images --------------------------------------------------------------------------

    def _images(self) -> list[Path]:
        images = self.root / "images"
        images.mkdir()
        workload = build_rootfs(images / "workload")
        nvml = workload / "usr" / "bin" / "nvml-total"
        source = images / "nvml_total.c"
        build_nvml_total(nvml, source)
        return [
            write_archive(workload, WORKLOAD_IMAGE, images / "workload.tar"),
            write_archive(workload, CGPUD_IMAGE, images / "cgpud.tar"),
            write_archive(pause_root(images / "pause"), PAUSE_IMAGE, images / "pause.tar", ["/bin/pause"]),
        ]

    # ---- nodes ---------------------------------------------------------------------------

    def _make_node(self, i: int) -> RealNode:
        name = f"node-{i}"
        host_ip, ip = self.host_ip(i), self.node_ip(i)
        netns = node_network(self._stack, self.tag, i, host_ip, ip)
        _run("ip", "-n", netns, "route", "add", "default", "via", host_ip)

        directory = self.root / f"n{i}"
        directory.mkdir()
        self._stack.callback(self._clean_node, directory, self._cgroup_name(i))  # after its processes stopped
        # A node's mounts are shared under systemd; the root of these VMs is
        # private, and mountPropagation (the DaemonSet's) needs them shared.
        _run("mount", "--bind", str(directory), str(directory))
        _run("mount", "--make-rshared", str(directory))
        sim = self.sim_root / name  # GPU pods mount sim_root and pick their node's by name (workload_pod)
        sim.mkdir(parents=True)
        sim_env = dict(os.environ)
        sim_env["LD_LIBRARY_PATH"] = str(native_dir() / "sim")
        sim_env["CGPU_SIM_CONFIG"] = str(
            write_sim_config(sim / "sim.conf", gpus=self.gpus, mem=self.gpu_memory, placements=self.placements)
        )
        sim_env["CGPU_SIM_STATE"] = str(sim / "sim.state")
        node = RealNode(
            i,
            name,
            netns,
            host_ip,
            ip,
            directory,
            sim_env,
            containerd=Process("containerd", [], directory / "containerd.log"),
            kubelet=Process("kubelet", [], directory / "kubelet.log"),
        )
        self._start_containerd(node)
        self._start_kubelet(node)
        until(
            lambda: node.kubelet.check() or self.kubectl("get", "node", name, check=False).returncode == 0,
            WAIT,
            interval=0.2,
            what=f"Node {name} registered",
            explain=node.kubelet.tail,
        )
        return node

    @staticmethod
    def _clean_node(directory: Path, cgroup: str) -> None:
        """What a node leaves when its containerd and kubelet are gone goes
        with it: the shims and containers they started (the shims outlive
        containerd, as on a real node), the mounts (pod volumes, container
        roots, cgpud's instance regions) and the node's cgroups."""
        socket = f"{directory}/containerd.sock"
        groups = [h / cgroup for h in Path("/sys/fs/cgroup").iterdir() if (h / cgroup).is_dir()]
        for _ in range(50):
            pids = {int(x) for g in groups for procs in g.rglob("cgroup.procs") for x in procs.read_text().split()}
            for proc in Path("/proc").iterdir():
                if proc.name.isdigit():
                    try:
                        if socket in (proc / "cmdline").read_bytes().decode(errors="replace").split("\0"):
                            pids.add(int(proc.name))
                    except OSError:
                        pass
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        _unmount_regions(directory)
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for point in sorted(
            (p for p in points if p == str(directory) or p.startswith(f"{directory}/")), key=len, reverse=True
        ):
            subprocess.run(["umount", "-l", point], capture_output=True)
        for group in groups:
            _remove_cgroup(group)

    def _containerd_config(self, node: RealNode) -> str:
        d = node.dir
        (d / "cni" / "net.d").mkdir(parents=True)
        (d / "cni" / "net.d" / "10-lo.conflist").write_text(
            json.dumps({"cniVersion": "0.4.0", "name": "lo-only", "plugins": [{"type": "loopback"}]})
        )
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        return "\n".join(
            [
                "version = 3",
                f"root = '{d / 'containerd' / 'root'}'",
                f"state = '{d / 'containerd' / 'state'}'",
                "[grpc]",
                f"  address = '{node.containerd_socket}'",
                "[ttrpc]",
                f"  address = '{node.containerd_socket}.ttrpc'",
                f"[{runtime}]",
                "  enable_cdi = true",
                f"  cdi_spec_dirs = ['{node.cdi_dir}']",
                # no CAP_SYS_RESOURCE on these machines: runc could not lower a score
                "  restrict_oom_score_adj = true",
                f"[{runtime}.cni]",
                f"  bin_dirs = ['{CNI_BIN}']",
                f"  conf_dir = '{d / 'cni' / 'net.d'}'",
                f"[{runtime}.containerd.runtimes.runc]",
                "  runtime_type = 'io.containerd.runc.v2'",
                f"[{runtime}.containerd.runtimes.runc.options]",
                "  SystemdCgroup = false",
                f"  Root = '{d / 'runc'}'",
                "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
                f"  sandbox = '{PAUSE_IMAGE}'",
                "",
            ]
        )

    def _start_containerd(self, node: RealNode) -> None:
        config = node.dir / "containerd.toml"
        config.write_text(self._containerd_config(node))
        node.cdi_dir.mkdir()
        env = dict(os.environ, PATH=f"{self.bin.bin}:{os.environ['PATH']}")
        node.containerd = self._process(
            "containerd",
            [str(self.bin["containerd"]), "--config", str(config)],
            node.netns,
            env,
            node.dir / "containerd.log",
        )
        until(
            lambda: node.containerd.check() or node.containerd_socket.exists(),
            WAIT,
            interval=0.2,
            what=f"containerd of {node.name}",
            explain=node.containerd.tail,
        )
        for archive in self.images:
            _run(
                str(self.bin["ctr"]),
                "--address",
                str(node.containerd_socket),
                "-n",
                "k8s.io",
                "images",
                "import",
                str(archive),
                timeout=120,
            )

    def _cgroup_name(self, i: int) -> str:
        return f"cgk{self.tag}n{i}"

    def _cgroup_root(self, node: RealNode) -> str:
        """The node's own cgroup in every v1 hierarchy (the kubelet wants it
        there before it starts), removed with the node (_clean_node): two
        kubelets on one host must not share kubepods."""
        name = self._cgroup_name(node.index)
        for hierarchy in sorted(Path("/sys/fs/cgroup").iterdir()):
            if hierarchy.name == "unified" or not hierarchy.is_dir():
                continue
            group = hierarchy / name
            group.mkdir(exist_ok=True)
            for inherited in ("cpuset.cpus", "cpuset.mems"):  # an empty cpuset takes no task
                if (hierarchy / inherited).exists():
                    (group / inherited).write_text((hierarchy / inherited).read_text())
        return f"/{name}"

    def _start_kubelet(self, node: RealNode) -> None:
        d = node.kubelet_dir
        d.mkdir()
        client = self.pki.client(f"kubelet-{node.name}", f"system:node:{node.name}", ["system:nodes"])
        serving = self.pki.server(f"kubelet-serving-{node.name}", [node.ip], [node.name])
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {
                "x509": {"clientCAFile": str(self.pki.ca)},
                "webhook": {"enabled": False},
                "anonymous": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "tlsCertFile": str(serving[0]),
            "tlsPrivateKeyFile": str(serving[1]),
            "address": node.ip,
            "healthzBindAddress": "127.0.0.1",
            "readOnlyPort": 0,
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "cgroupRoot": self._cgroup_root(node),
            "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
            "failSwapOn": False,
            "oomScoreAdj": 0,
            "resolvConf": "",
            "podLogsDir": str(node.dir / "pod-logs"),
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "nodeStatusUpdateFrequency": "5s",
            "serializeImagePulls": False,
            "registerNode": True,
        }
        path = node.dir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        config_file = kubeconfig(node.dir / "kubelet.kubeconfig", self.api_url(node.host_ip), self.pki.ca, cert=client)
        kubelet = [
            str(self.bin["kubelet"]),
            f"--config={path}",
            f"--kubeconfig={config_file}",
            f"--root-dir={d}",
            f"--hostname-override={node.name}",
            f"--node-ip={node.ip}",
            "--v=2",
        ]
        node.kubelet = self._process(
            "kubelet", self._own_device_plugin_dir(node, kubelet), node.netns, None, node.dir / "kubelet.log"
        )

    def _own_device_plugin_dir(self, node: RealNode, command: list[str]) -> list[str]:
        """The kubelet's device-plugin directory is fixed at
        /var/lib/kubelet/device-plugins, whatever --root-dir says; each
        kubelet here runs in a mount namespace of its own where that path is
        its node's directory. Its root dir is a shared mount first, so the
        volumes it mounts for pods (service account tokens) reach containerd
        in the host's namespace."""
        d = node.kubelet_dir
        _run("mount", "--bind", str(d), str(d))
        self._stack.callback(_run, "umount", "-l", str(d), check=False)
        _run("mount", "--make-shared", str(d))
        node.device_plugin_dir.mkdir()
        fixed = Path("/var/lib/kubelet/device-plugins")
        if not fixed.exists():
            fixed.mkdir(parents=True)
            self._stack.callback(_remove_if_empty, fixed)
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        return [
            "unshare",
            "--mount",
            "--propagation",
            "unchanged",
            "--",
            "sh",
            "-c",
            script,
            "kubelet-ns",
            str(node.device_plugin_dir),
            str(fixed),
            *command,
        ]

    def restart_kubelet(self, node: RealNode) -> None:
        """The kubelet stopped and started again with the same flags, as
        `systemctl restart kubelet` does: it deletes the plugin sockets."""
        node.kubelet.stop()
        node.kubelet = self._process("kubelet", node.kubelet.command, node.netns, None, node.kubelet.log)

    def wait_node_ready(self, node: RealNode, timeout: float = WAIT) -> None:
        def ready() -> bool:
            node.kubelet.check()
            done = self.kubectl(
                "get", "node", node.name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False
            )
            return done.stdout.strip() == "True"

        until(ready, timeout, interval=0.2, what=f"Node {node.name} Ready", explain=node.kubelet.tail)

    # ---- cgpud as a host service -----------------------------------------------------------

    def start_cgpud(self, node: RealNode, *extra: str) -> Process:
        """cgpud on the node as a host service (not in a pod), with a token
        of its ServiceAccount bound to the node's Node, as the DaemonSet's
        pod token is bound to the node it runs on."""
        d = node.cgpud_dir
        (d / "run").mkdir(parents=True, exist_ok=True)
        token = self.token("cgpud", "kube-system", "--bound-object-kind", "Node", "--bound-object-name", node.name)
        config = kubeconfig(d / "kubeconfig", self.api_url(node.host_ip), self.pki.ca, token=token)
        cert, key = self.capacity_pki.node_cert(node.name, ips=[node.ip])
        (d / "none.toml").write_text("")
        env = dict(node.sim_env)
        env["PATH"] = f"{BIN}:{native_path('bin/cgpu-burn').parent}:{env['PATH']}"
        command = [
            str(BIN / "cgpud"),
            "--orchestrator",
            "kubernetes",
            "--node-name",
            node.name,
            "--kubeconfig",
            str(config),
            "--config",
            str(d / "none.toml"),
            "--state-dir",
            str(d / "state"),
            "--socket",
            str(node.cgpud_socket),
            "--relay-socket",
            str(d / "run" / "relay.sock"),
            "--device-plugin-dir",
            str(node.device_plugin_dir),
            "--pod-resources-socket",
            str(node.kubelet_dir / "pod-resources" / "kubelet.sock"),
            "--cdi-dir",
            str(node.cdi_dir),
            "--capacity-listen",
            f"{node.ip}:{CAPACITY_PORT}",
            "--capacity-tls-cert",
            str(cert),
            "--capacity-tls-key",
            str(key),
            "--capacity-tls-ca",
            str(self.capacity_pki.ca),
            "--sweep-interval",
            "0.5",
            "--dev-root",
            str(self.dev_root),
            *extra,
        ]
        node.cgpud = self._process("cgpud", command, node.netns, env, d / "cgpud.log")
        until(
            lambda: (
                node.cgpud.check()  # type: ignore[union-attr]
                or node.cgpuctl("list").returncode == 0
            ),
            WAIT,
            interval=0.2,
            what=f"cgpud of {node.name} answering",
            explain=node.cgpud.tail,
        )
        return node.cgpud

    def gpu_node(self, node: RealNode, mode: str = "core_mem") -> None:
        """The node as a GPU node: cgpud running as a host service, the mode label set."""
        if node.cgpud is None or not node.cgpud.alive():
            self.start_cgpud(node)
        self.kubectl("label", "node", node.name, f"ack.node.gpu.schedule={mode}", "--overwrite")

    # ---- cgpud as the DaemonSet ------------------------------------------------------------

    def cgpud_daemonset(self, node: RealNode) -> dict[str, Any]:
        """deploy/cgpud-daemonset.yaml for this machine. What differs, and why:
        - image: the one this repository's users build (`pip install .`) is
          not built here; a busybox image runs the host's installation, whose
          Python, virtualenv, checkout and /usr come in read-only hostPaths;
        - the simulated GPU's driver and state, where a real node has the
          driver's device nodes and libraries;
        - the API server: no kube-proxy runs here, so the Service address the
          kubelet gives pods is replaced by the API server's own;
        - the driver's device nodes are under a dev_root, as a driver
          container's are (mounted at the same path, as the GPU Operator's);
        - node paths: every node of this harness shares one host, so the
          host paths are the node's directories. Those that cgpud's CDI specs
          name to containerd (its state and sockets) keep host path = pod
          path, as on a node, and cgpud is told them."""
        [ds] = self.manifests("cgpud-daemonset.yaml")
        d = node.dir / "ds"
        state, run, config, tls = d / "state", d / "run", d / "etc", d / "capacity-tls"
        for directory in (state, run, config, tls):
            directory.mkdir(parents=True, exist_ok=True)
        # Bidirectional propagation needs a shared host mount; the root of
        # these VMs is private (systemd makes it shared on a real node).
        _run("mount", "--bind", str(state), str(state))
        _run("mount", "--make-shared", str(state))
        cert, key = self.capacity_pki.node_cert(node.name, ips=[node.ip])
        for source, name in ((cert, "tls.crt"), (key, "tls.key"), (self.capacity_pki.ca, "ca.crt")):
            shutil.copy(source, tls / name)
        pod = ds["spec"]["template"]["spec"]
        [container] = pod["containers"]
        container["image"], container["imagePullPolicy"] = CGPUD_IMAGE, "Never"
        container["command"] = [
            *container["command"],
            "--state-dir",
            str(state),
            "--socket",
            str(run / "cgpud.sock"),
            "--relay-socket",
            str(run / "relay.sock"),
            "--sweep-interval",
            "0.5",
            "--dev-root",
            str(self.dev_root),
        ]
        venv, base = Path(sys.prefix), Path(sys.base_prefix)
        sim = self.sim_root
        container["env"] += [
            {"name": "PATH", "value": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"},
            {"name": "LD_LIBRARY_PATH", "value": node.sim_env["LD_LIBRARY_PATH"]},
            {"name": "CGPU_SIM_CONFIG", "value": f"{sim}/$(NODE_NAME)/sim.conf"},
            {"name": "CGPU_SIM_STATE", "value": f"{sim}/$(NODE_NAME)/sim.state"},
            {"name": "KUBERNETES_SERVICE_HOST", "value": node.host_ip},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.api_port)},
        ]
        host_paths = {
            "device-plugins": node.device_plugin_dir,
            "pod-resources": node.kubelet_dir / "pod-resources",
            "cdi": node.cdi_dir,
            "run": run,
            "state": state,
            "config": config,
            "capacity-tls": tls,
            "runtime-state": node.dir / "containerd" / "state",
        }
        for volume in pod["volumes"]:
            if volume["name"] in host_paths:
                volume["hostPath"]["path"] = str(host_paths[volume["name"]])
        for mount in container["volumeMounts"]:
            if mount["name"] in ("run", "state", "runtime-state"):
                mount["mountPath"] = str(host_paths[mount["name"]])
        pod["volumes"].append({"name": "driver-root", "hostPath": {"path": str(self.dev_root), "type": "Directory"}})
        container["volumeMounts"].append({"name": "driver-root", "mountPath": str(self.dev_root), "readOnly": True})
        for i, path in enumerate(dict.fromkeys([venv, base, REPO, Path("/usr"), native_dir()])):
            pod["volumes"].append({"name": f"host-{i}", "hostPath": {"path": str(path), "type": "Directory"}})
            container["volumeMounts"].append({"name": f"host-{i}", "mountPath": str(path), "readOnly": True})
        pod["volumes"].append({"name": "sim", "hostPath": {"path": str(sim), "type": "Directory"}})
        container["volumeMounts"].append({"name": "sim", "mountPath": str(sim)})
        return ds

    def workload_pod(
        self,
        name: str,
        command: str,
        limits: dict[str, Any] | None = None,
        *,
        node: str | None = None,
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A pod of the workload image. It plays the NVIDIA toolkit's part as
        tests/harness/oci.py does: the driver libraries are in the image, and the
        (simulated) device state of whichever node it lands on comes in by a
        hostPath and two variables; cgpu gives it nothing else."""
        sim = str(self.sim_root)
        spec: dict[str, Any] = {
            "hostNetwork": True,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": WORKLOAD_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                    "resources": {"limits": limits or {}},
                    "env": [
                        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "CGPU_SIM_CONFIG", "value": f"{sim}/$(NODE_NAME)/sim.conf"},
                        {"name": "CGPU_SIM_STATE", "value": f"{sim}/$(NODE_NAME)/sim.state"},
                    ],
                    "volumeMounts": [{"name": "gpu", "mountPath": sim}],
                }
            ],
            "volumes": [{"name": "gpu", "hostPath": {"path": sim, "type": "Directory"}}],
        }
        if node:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}},
            "spec": spec,
        }

    def pod_phase(self, name: str, namespace: str = "default") -> str:
        done = self.kubectl("get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}", check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def wait_pod(
        self, name: str, phases: Sequence[str] = ("Succeeded",), timeout: float = WAIT, namespace: str = "default"
    ) -> str:
        def reached() -> bool:
            return self.pod_phase(name, namespace) in phases

        until(
            reached,
            timeout,
            interval=0.2,
            what=f"pod {namespace}/{name} {'/'.join(phases)}",
            explain=lambda: self.describe(name, namespace),
        )
        return self.pod_phase(name, namespace)

    def describe(self, name: str, namespace: str = "default") -> str:
        out = self.kubectl("describe", "pod", name, "-n", namespace, check=False)
        return (out.stdout + out.stderr)[-4000:]

    def logs(self, name: str, namespace: str = "default") -> str:
        return self.kubectl("logs", name, "-n", namespace).stdout

    def extender_inspect(self) -> dict[str, Any]:
        """cgpu-scheduler's GET /inspect."""
        context = ssl.create_default_context(cafile=str(self.capacity_pki.ca))
        with urllib.request.urlopen(f"{self.extender_url}/inspect", timeout=10, context=context) as r:
            return cast(dict[str, Any], json.loads(r.read()))

    def extender_nodes(self) -> dict[str, dict[str, Any]]:
        """cgpu-scheduler's GET /inspect: node name -> its entry (address,
        connected, error, state)."""
        return {n["name"]: n for n in self.extender_inspect()["nodes"]}

    def extender_view(self) -> dict[str, dict[str, Any]]:
        """Node name -> its state as cgpu-scheduler sees it (what it places by)."""
        return {name: n.get("state") or {} for name, n in self.extender_nodes().items()}

    def allocatable(self, node: RealNode) -> dict[str, str]:
        return dict(self.get("node", node.name)["status"].get("allocatable", {}))
