"""cgpud's cluster parts: the kubelet device plugin and the API server agent
(kubernetes mode), GPU health, and the Capacity API (capacity_listen).
daemon.py imports this module only on a node that has one of them: their
imports (the API server client, the device plugin and Capacity services)
were about a fifth of a standalone node's start (bench/bench_daemon_start.py),
which such a node need not pay."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import structlog

from cgpud.api.capacity import CapacityServicer, node_facts
from cgpud.api.capacity_server import CapacityTls, advertised, serve_capacity
from cgpud.api.listen import parse_endpoint
from cgpud.config import DaemonConfig
from cgpud.containers.edits import RuntimeFiles
from cgpud.daemon.stats import CountedAllocator, DaemonStats
from cgpud.errors import CgpuError, UsageError
from cgpud.kube import mig
from cgpud.kube.agent import KubeAgent, kubeconfig_path, node_name
from cgpud.kube.apiserver import LazyApiServer
from cgpud.kube.health import HealthWatcher, healthy_by_index
from cgpud.kube.model import ANNOTATION_CAPACITY_ADDRESS
from cgpud.kube.node_labels import initial_policy
from cgpud.kube.plugin import DevicePlugin, PluginSettings
from cgpud.node import host
from cgpud.node.inventory import Inventory
from cgpud.node.model import GpuCapacity, NodePolicy, Orchestrator
from cgpud.node.service import InstanceService


class ClusterParts:
    """Built before the instance service (the Node's labels decide the
    node's first policy); start() brings the parts up once the node serves."""

    def __init__(self, config: DaemonConfig) -> None:
        self._config = config
        kube = config.orchestrator is Orchestrator.KUBERNETES
        self._api = LazyApiServer(kubeconfig_path(config.kubeconfig)) if kube else None  # None: no agent
        self._log = structlog.get_logger("cgpud.kube")

    def initial_policy(self, policy: NodePolicy) -> NodePolicy:
        """The Node's labels win over the file (kubernetes mode)."""
        if self._api is None:
            return policy
        return initial_policy(self._api, node_name(self._config.node_name), policy)

    def start(
        self,
        stack: ExitStack,
        stop: threading.Event,
        service: InstanceService,
        inventory: Inventory,
        gpus: Sequence[GpuCapacity],
        policy: NodePolicy,
        files: RuntimeFiles,
        stats: DaemonStats,
    ) -> list[Callable[[], object]]:
        """Starts each part, its stop pushed on `stack`; returns what the
        sweep loop must also run."""
        config = self._config
        agent = health = None
        if self._api is not None:
            migs = mig.plan(config.mig_strategy, inventory.gpus, shared=config.mig_share)
            if migs.problem:
                self._log.warning("MIG devices not served as they are", problem=migs.problem)
            card_labels = {
                **inventory.card_labels(),
                **mig.gfd_labels(
                    config.mig_strategy,
                    inventory.gpus,
                    any(g.mig_capable for g in inventory.gpus),
                    shared=config.mig_share,
                ),
            }
            agent = KubeAgent(
                service,
                self._api,
                node_name(config.node_name),
                files,
                config.policy(),
                card_labels,
                cdi_dir=config.cdi_dir,
                dev_root=config.dev_root,
                pod_resources_socket=config.pod_resources_socket,
                min_pod_priority=config.pod_share_priority_min,
                mig_devices=migs.by_uuid(),
            )
            plugin = DevicePlugin(
                PluginSettings(config.device_plugin_dir),
                CountedAllocator(agent.allocator, stats),
                mode=policy.mode,
                placement=policy.placement,
                gpus=gpus,
                links=inventory.links(),
                mig=migs,
            ).start()
            stack.callback(plugin.stop)
            agent.on_policy = lambda p: plugin.update(mode=p.mode, placement=p.placement)
            health = self._watch_gpu_health(inventory.gpus, plugin, service.changes.bump)
        elif config.capacity_listen:
            health = self._watch_gpu_health(inventory.gpus, None, service.changes.bump)
        if health is not None:
            stack.callback(health.stop)
        annotations: dict[str, str] = {}
        if config.capacity_listen:
            capacity, address = self._serve_capacity(service, inventory, health)
            stack.callback(lambda: capacity.stop(grace=1).wait())
            if address:
                annotations[ANNOTATION_CAPACITY_ADDRESS] = address
        if agent is None:
            return []
        agent.start(stop, annotations)
        stack.callback(agent.stop)
        return [agent.sweep]

    def _watch_gpu_health(
        self, gpus: Sequence[Any], plugin: DevicePlugin | None, changed: Callable[[], object]
    ) -> HealthWatcher | None:
        """GPU health into the device plugin's ListAndWatch (when there is one)
        and the Capacity API's views (`changed` bumps their revision); None when
        NVML cannot watch (then GPUs stay Healthy rather than the node losing
        its capacity, and the log says so)."""
        config = self._config

        def on_change(snap: Any) -> None:
            if plugin is not None:
                plugin.update(health=healthy_by_index(snap))
            changed()

        watcher = HealthWatcher(
            gpus, on_change, policy=config.health_policy(), probe_interval=config.gpu_health_probe_interval
        )
        try:
            watcher.start()
        except CgpuError as e:
            self._log.error("GPU health is not watched: GPUs are advertised Healthy", error=str(e))
            return None
        if plugin is not None:
            plugin.update(health=healthy_by_index(watcher.snapshot()))  # start()'s first verdicts reach no callback
        changed()
        return watcher

    def _serve_capacity(
        self, service: InstanceService, inventory: Inventory, health: HealthWatcher | None
    ) -> tuple[Any, str]:
        """The Capacity API on capacity_listen, and the HOST:PORT to advertise
        ("" when there is none: listening on every address of a node without a
        primary one; only kubernetes mode needs it, and refuses to start then)."""
        config = self._config
        tls = CapacityTls.from_settings(config.capacity_tls_cert, config.capacity_tls_key, config.capacity_tls_ca)
        primary = host.primary_address()
        listen = parse_endpoint(config.capacity_listen, "capacity_listen")
        try:
            address_host = advertised(listen, config.capacity_advertise, primary).host  # the port may be 0 until bound
        except UsageError:
            if self._api is not None:  # kubernetes mode: the Node must name an address
                raise
            address_host = ""

        def gpu_health() -> dict[int, tuple[bool, str]]:
            if health is None:
                return {}
            by_gpu = {i: (h.healthy, h.reason) for i, h in health.snapshot().items()}
            # A MIG device taken as a GPU (mig_share) is as healthy as the GPU it is on.
            return by_gpu | {g.index: by_gpu[g.parent] for g in service.gpus() if g.parent in by_gpu}

        facts = node_facts(inventory, node_name(config.node_name), [primary, address_host])
        server = serve_capacity(
            CapacityServicer(service, facts, gpu_health), config.capacity_listen, tls, config.capacity_insecure
        )
        address = str(advertised(server.endpoint, config.capacity_advertise, primary)) if address_host else ""
        structlog.get_logger("cgpud.capacity").info("capacity address", advertise=address)
        return server, address
