"""cgpud entry point: parse settings, wire the parts, run until told to stop."""
from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from cgpud import __version__
from cgpud.daemon import config as settings
from cgpud.daemon import node
from cgpud.daemon.inventory import read_inventory
from cgpud.daemon.model import GpuCapacity, Orchestrator
from cgpud.daemon.compute import ComputeScheduler
from cgpud.daemon.compute_policy import limits_compute
from cgpud.daemon.exits import ExitWatch
from cgpud.daemon.service import InstanceService
from cgpud.daemon.store import Store
from cgpud.errors import CgpuError, UsageError
from cgpud.logs import configure_logging
from cgpud.signals import StopSignals

if TYPE_CHECKING:
    from cgpud.daemon.bypass_model import BypassEvents
    from cgpud.daemon.metrics import DaemonStats
    from cgpud.daemon.notify import Heartbeat
    from cgpud.daemon.watchdog import BypassWatchdog


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cgpud", description="cgpu node daemon: GPU inventory, instance tables, local API.")
    p.add_argument("--version", action="version", version=f"cgpud {__version__}")
    p.add_argument("--inventory", action="store_true", help="print this node's GPU inventory as JSON and exit")
    settings.add_arguments(p)
    return p


def _sweeper(service: InstanceService, interval: float, stop: threading.Event,
             also: Sequence[Callable[[], object]] = (), stats: DaemonStats | None = None,
             heartbeat: Heartbeat | None = None) -> None:
    log = structlog.get_logger("cgpud.sweep")
    own: Callable[[], object] = service.sweep if stats is None else lambda: stats.timed("sweep", service.sweep)
    while not stop.wait(interval):
        for sweep in (own, *also):
            try:
                sweep()
            except (CgpuError, OSError, MemoryError) as e:  # keep sweeping: the next round may succeed
                log.error("sweep failed", error=str(e))
        if heartbeat is not None:  # a round done, failed or not: the loop turns
            heartbeat.beat()


def _private_state_dir(path: Path) -> None:
    """The instance tables and regions are root's alone (0700); an older
    cgpud made the directory 0755. Containers reach the files they need
    through bind mounts, which do not cross this directory's mode."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_mode & 0o077:
            path.chmod(0o700)
    except OSError as e:
        raise CgpuError(f"cannot prepare the state directory {path}: {e.strerror}") from e


def _bypass_watchdog(config: settings.DaemonConfig, service: InstanceService, gpus: Sequence[GpuCapacity],
                     events: BypassEvents, stats: DaemonStats) -> tuple[BypassWatchdog | None, Callable[[], object]]:
    """The bypass watchdog (not started) and what closes its NVML; None
    when bypass_interval is 0 or there is no GPU. It is built whatever the
    mode: node labels may turn an isolating mode on later, and until then
    its rounds only read the policy."""
    if config.bypass_interval <= 0 or not gpus:
        return None, lambda: None
    from cgpud.daemon.procmap import ProcessMapper
    from cgpud.daemon.watchdog import BypassWatchdog, NvmlProcessReader

    reader = NvmlProcessReader([g.index for g in gpus], config.bypass_compute_window)
    watchdog = BypassWatchdog(service, events, reader, ProcessMapper(), config.watch_settings(), config.bypass_action,
                              config.bypass_interval, stats=stats)
    return watchdog, reader.close


def _bypass_watching(config: settings.DaemonConfig, watchdog: BypassWatchdog | None) -> Callable[[], tuple[bool, str]]:
    """Whether the watchdog looks now, and why not, for the admin API."""
    if watchdog is not None:
        return watchdog.watching
    reason = "bypass_interval is 0" if config.bypass_interval <= 0 else "this node has no GPU"
    return lambda: (False, reason)


def _watch_gpu_health(config: settings.DaemonConfig, gpus: Sequence[Any], plugin: Any,
                      changed: Callable[[], object]) -> Any:
    """GPU health into the device plugin's ListAndWatch (when there is one)
    and the Capacity API's views (`changed` bumps their revision); None when
    NVML cannot watch (then GPUs stay Healthy rather than the node losing
    its capacity, and the log says so)."""
    from cgpud.kube.health import HealthWatcher, healthy_by_index

    def on_change(snap: Any) -> None:
        if plugin is not None:
            plugin.update(health=healthy_by_index(snap))
        changed()

    watcher = HealthWatcher(gpus, on_change, policy=config.health_policy(),
                            probe_interval=config.gpu_health_probe_interval)
    try:
        watcher.start()
    except CgpuError as e:
        structlog.get_logger("cgpud.kube").error("GPU health is not watched: GPUs are advertised Healthy",
                                                 error=str(e))
        return None
    if plugin is not None:
        plugin.update(health=healthy_by_index(watcher.snapshot()))  # start()'s first verdicts reach no callback
    changed()
    return watcher


def _serve_capacity(config: settings.DaemonConfig, service: InstanceService, inventory: Any, health: Any,
                    kube: bool) -> tuple[Any, str]:
    """The Capacity API on capacity_listen, and the HOST:PORT to advertise
    ("" when there is none: listening on every address of a node without a
    primary one; only kubernetes mode needs it, and refuses to start then)."""
    from cgpud.api.capacity import CapacityServicer, node_facts
    from cgpud.api.capacity_server import CapacityTls, advertised, serve_capacity
    from cgpud.api.listen import parse_endpoint
    from cgpud.kube.agent import node_name

    tls = CapacityTls.from_settings(config.capacity_tls_cert, config.capacity_tls_key, config.capacity_tls_ca)
    primary = node.primary_address()
    listen = parse_endpoint(config.capacity_listen, "capacity_listen")
    try:
        host = advertised(listen, config.capacity_advertise, primary).host  # the port may be 0 until bound
    except UsageError:
        if kube:
            raise
        host = ""

    def gpu_health() -> dict[int, tuple[bool, str]]:
        if health is None:
            return {}
        return {i: (h.healthy, h.reason) for i, h in health.snapshot().items()}

    facts = node_facts(inventory, node_name(config.node_name), [primary, host])
    server = serve_capacity(CapacityServicer(service, facts, gpu_health), config.capacity_listen, tls,
                            config.capacity_insecure)
    address = str(advertised(server.endpoint, config.capacity_advertise, primary)) if host else ""
    structlog.get_logger("cgpud.capacity").info("capacity address", advertise=address)
    return server, address


def run(config: settings.DaemonConfig) -> int:
    # Imported here: the API pulls in grpc, which --inventory does not need.
    from cgpud.api.server import serve
    from cgpud.daemon.notify import Heartbeat, Notifier, heartbeat_max_age, start_watchdog
    from cgpud.containers import cdi
    from cgpud.containers.lifecycle import ContainerLifecycle
    from cgpud.containers.relay import RelayServer
    from cgpud.containers import runtime_files
    from cgpud.containers.devices import gpu_node
    from cgpud.daemon.bypass_model import BypassEvents
    from cgpud.daemon.metrics import CountedAllocator, DaemonStats

    log = structlog.get_logger("cgpud")
    # Refused before anything starts: a watchdog too short for the sweep.
    max_age = heartbeat_max_age(Notifier.from_env(), config.sweep_interval)
    inventory = read_inventory()
    gpus = tuple(GpuCapacity(g.index, g.uuid, g.memory_total, gpu_node(g.minor_number)) for g in inventory.gpus)
    _private_state_dir(config.state_dir)
    store = Store(config.database)
    kube = config.orchestrator is Orchestrator.KUBERNETES
    policy = config.policy()
    if kube:
        from cgpud.kube.agent import kubeconfig_path, node_name
        from cgpud.kube.apiserver import LazyApiServer
        from cgpud.kube.node_labels import initial_policy
        api = LazyApiServer(kubeconfig_path(config.kubeconfig))
        policy = initial_policy(api, node_name(config.node_name), policy)  # the Node's labels win over the file
    start_compute = (lambda: ComputeScheduler(len(gpus), config.timing()).start()) if gpus else None
    compute = start_compute() if start_compute and limits_compute(policy.mode) else None
    exits = ExitWatch()
    service = InstanceService(store, gpus, policy, config.regions, inventory.driver_version, node.boot_id(),
                              compute=compute, tmpfs_regions=True, start_compute=start_compute,
                              reservation_ttl=config.reservation_ttl, exits=exits)
    stop = threading.Event()
    exits.start(service.init_exited, stop)
    stats = DaemonStats()
    stats.timed("reconcile", service.reconcile)
    service.refill_region_spare()
    events = BypassEvents()
    bypass, close_bypass = _bypass_watchdog(config, service, gpus, events, stats)
    metrics = None
    if config.metrics_listen:
        from cgpud.daemon.metrics import serve_metrics
        metrics = serve_metrics(config.metrics_listen, service, stats, __version__,
                                {g.index: g.name for g in inventory.gpus}, events=events)
    files = runtime_files.install_runtime_files(config.state_dir, config.relay_socket)
    trust_env = config.orchestrator is Orchestrator.STANDALONE
    relay = RelayServer(ContainerLifecycle(service, files, trust_env), config.relay_socket,
                        on_request=lambda verb, code: stats.request("relay", verb, code)).start()
    server = serve(service, config.socket, cdi_spec=lambda: cdi.render(service, files),
                   on_request=lambda method, code: stats.request("admin", method, code),
                   events=events, watching=_bypass_watching(config, bypass))
    notifier = Notifier.from_env()
    signals = StopSignals(stop)
    # Old versions' runtime files go once no active instance uses them.
    also: list[Callable[[], object]] = [
        lambda: runtime_files.collect(service, files, runtime_files.runtime_root(config.state_dir))]
    plugin = agent = health = capacity = None
    if kube:
        from cgpud.kube.agent import KubeAgent
        from cgpud.kube.plugin import DevicePlugin, PluginSettings
        agent = KubeAgent(service, api, node_name(config.node_name), files, config.policy(), inventory.card_labels(),
                          cdi_dir=config.cdi_dir, pod_resources_socket=config.pod_resources_socket)
        plugin = DevicePlugin(PluginSettings(config.device_plugin_dir), CountedAllocator(agent.allocator, stats),
                              mode=policy.mode, placement=policy.placement, gpus=gpus).start()
        agent.on_policy = lambda p: plugin.update(mode=p.mode, placement=p.placement)
        health = _watch_gpu_health(config, inventory.gpus, plugin, service.changes.bump)
    elif config.capacity_listen:
        health = _watch_gpu_health(config, inventory.gpus, None, service.changes.bump)
    annotations: dict[str, str] = {}
    if config.capacity_listen:
        from cgpud.kube.model import ANNOTATION_CAPACITY_ADDRESS
        capacity, address = _serve_capacity(config, service, inventory, health, kube)
        if address:
            annotations[ANNOTATION_CAPACITY_ADDRESS] = address
    if agent is not None:
        agent.start(stop, annotations)
        also.append(agent.sweep)
    # Pings vouch for the sweep loop: it touches the store, the instance
    # table and the kubelet/API server clients every round.
    heartbeat = Heartbeat()
    threading.Thread(target=_sweeper, args=(service, config.sweep_interval, stop, also, stats, heartbeat),
                     daemon=True).start()
    bypass_thread = bypass.start(stop) if bypass is not None else None
    start_watchdog(notifier, stop, healthy=None if max_age is None else lambda: heartbeat.fresh(max_age))
    notifier.ready()  # only now: reconciled and serving
    log.info("ready", socket=str(config.socket), gpus=len(gpus), mode=policy.mode.value,
             bypass_interval=config.bypass_interval if bypass is not None else 0,
             bypass_action=config.bypass_action.value)
    signals.wait()
    notifier.stopping()
    log.info("stopping")
    if capacity is not None:
        capacity.stop(grace=1).wait()
    if plugin is not None:
        plugin.stop()
    if health is not None:
        health.stop()
    if agent is not None:
        agent.stop()
    relay.stop()
    if bypass_thread is not None:  # its wait ends with `stop`; a round under way finishes first
        bypass_thread.join(timeout=config.bypass_interval + 10)
    close_bypass()
    server.stop(grace=2).wait()
    if metrics is not None:
        metrics.stop()
    service.stop_compute()
    service.drop_region_spare()
    store.close()
    signals.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging()
    try:
        if args.inventory:
            print(json.dumps(read_inventory().as_dict(), indent=2))
            return 0
        return run(settings.from_arguments(args))
    except CgpuError as e:
        print(f"cgpud: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
