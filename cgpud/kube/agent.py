"""The API-server side of cgpud's node agent, put together for the
daemon's main: the Allocator the device plugin calls, pod releases for the
daemon's sweep, and the Node's labels followed in a thread.

Wiring, in order (cgpud/daemon/main.py):
    api = LazyApiServer(kubeconfig)
    policy = initial_policy(api, node, config.policy())   # before the service
    service = InstanceService(..., policy, ...)
    agent = KubeAgent(service, api, node, files, ...)
    plugin = DevicePlugin(..., agent.allocator, mode=policy.mode, ...)
    agent.on_policy = lambda p: plugin.update(mode=p.mode, placement=p.placement)
    agent.start(stop); sweeper calls agent.sweep() after service.sweep()"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from cgpud.containers.devices import HOST_ROOT
from cgpud.containers.edits import RuntimeFiles
from cgpud.node.model import NodePolicy
from cgpud.node.service import InstanceService
from cgpud.errors import CgpuError
from cgpud.kube.mig import ServedMig
from cgpud.kube.allocator import DYNAMIC_CDI_DIR, PodAllocator
from cgpud.kube.apiserver import LazyApiServer, PodInfo
from cgpud.kube.model import DEFAULT_MIN_POD_PRIORITY, DEFAULT_POD_RESOURCES_SOCKET
from cgpud.kube.node_labels import DEFAULT_INTERVAL, NodeLabels
from cgpud.kube import resources
from cgpud.kube.pod_resources import ContainerDevices, PodResourcesClient
from cgpud.kube.releases import PodReleaser, kubelet_pods
from cgpud.kube.resizer import PodResizer


def node_name(configured: str = "") -> str:
    """This node's name in the cluster: the setting, else NODE_NAME (the
    DaemonSet sets it from spec.nodeName), else the host name."""
    return configured or os.environ.get("NODE_NAME", "") or socket.gethostname()


def kubeconfig_path(configured: str = "") -> Path | None:
    """A kubeconfig file when one is set; None means in-cluster."""
    return Path(configured) if configured else None


class KubeAgent:
    def __init__(
        self,
        service: InstanceService,
        api: LazyApiServer,
        node: str,
        files: RuntimeFiles,
        configured: NodePolicy,
        card_labels: Mapping[str, str],
        *,
        cdi_dir: Path = DYNAMIC_CDI_DIR,
        dev_root: Path = HOST_ROOT,
        pod_resources_socket: Path = Path(DEFAULT_POD_RESOURCES_SOCKET),
        label_interval: float = DEFAULT_INTERVAL,
        min_pod_priority: int = DEFAULT_MIN_POD_PRIORITY,
        mig_devices: Mapping[str, ServedMig] | None = None,
    ) -> None:
        self.api = api
        self.node = node
        try:  # runtimes create it too; a spec written into a missing one would fail every Allocate
            cdi_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as e:
            structlog.get_logger("cgpud.kube").error(
                "cannot create the CDI spec directory", dir=str(cdi_dir), error=e.strerror
            )
        self.on_policy: Callable[[NodePolicy], None] | None = None  # set once the device plugin exists
        self.allocator = PodAllocator(
            service, api, node, files, cdi_dir, dev_root, min_pod_priority, migs=dict(mig_devices or {})
        )
        self.service = service
        self._kubelet = PodResourcesClient(pod_resources_socket)
        # The kubelet's pod-resources List of this sweep, or why there is none:
        # read once, for the releases and for the GPUs pods hold whole.
        self._listed: list[ContainerDevices] | CgpuError = []
        # The API server's pods on this node, listed at most once a sweep
        # for the releases and the resizes.
        self._api_pods: list[PodInfo] | None = None
        self.releaser = PodReleaser(service, self._api_listing, lambda: kubelet_pods(self._listing()), cdi_dir)
        self.resizer = PodResizer(service, api, node, self._api_listing, min_pod_priority)
        self.labels = NodeLabels(
            api, node, service, configured, card_labels, on_policy=self._policy_changed, interval=label_interval
        )

    def start(self, stop: threading.Event, annotations: Mapping[str, str] | None = None) -> KubeAgent:
        """`annotations` are kept on the Node by the label thread (the
        Capacity API's address), retried while the API server is away."""
        if annotations:
            self.labels.annotate(annotations)
        self.labels.start(stop)
        return self

    def sweep(self) -> int:
        """The GPUs pods hold whole into the node's books (cgpud keeps no
        instance for them; while the kubelet cannot be asked, the last answer
        stands), then the releases."""
        try:
            self._listed = self._kubelet.list()
        except CgpuError as e:  # the releaser says so, and waits
            self._listed = e
        else:
            self.service.set_whole_held(resources.whole_gpus_held(self._listed, self.service.gpus()))
        self._api_pods = None
        released = self.releaser.sweep()
        self.resizer.sweep()
        return released

    def _api_listing(self) -> list[PodInfo]:
        if self._api_pods is None:
            self._api_pods = self.api.pods_on_node(self.node)
        return self._api_pods

    def _listing(self) -> list[ContainerDevices]:
        if isinstance(self._listed, CgpuError):
            raise self._listed
        return self._listed

    def stop(self, timeout: float = 2.0) -> None:
        """After `stop` (the event) is set: wait for the label thread, close the client."""
        self.labels.join(timeout)
        self.api.close()

    def _policy_changed(self, policy: NodePolicy) -> None:
        if self.on_policy is not None:
            self.on_policy(policy)
