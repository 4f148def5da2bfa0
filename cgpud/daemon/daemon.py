"""cgpud's parts, started in order and stopped in reverse by construction:
each part's stop is pushed on an ExitStack as the part starts, so a start
that fails half-way unwinds exactly what it had started."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import structlog

from cgpud import __version__
from cgpud.api.server import serve
from cgpud.config import DaemonConfig
from cgpud.containers import cdi, runtime_files
from cgpud.containers.devices import gpu_node
from cgpud.containers.lifecycle import ContainerLifecycle
from cgpud.containers.relay import RelayServer
from cgpud.daemon.stats import DaemonStats
from cgpud.daemon.notify import Heartbeat, Notifier, heartbeat_max_age, start_keepalive
from cgpud.errors import CgpuError
from cgpud.kube import mig_devices
from cgpud.node import host
from cgpud.node.bypass_model import BypassEvents
from cgpud.node.bypass_watchdog import BypassWatchdog, NvmlProcessReader
from cgpud.node.compute import ComputeScheduler
from cgpud.node.compute_policy import limits_compute
from cgpud.node.exits import ExitWatch
from cgpud.node.inventory import Inventory, capacities, read_inventory
from cgpud.node.model import GpuCapacity, NodeMode, Orchestrator
from cgpud.node.mps import MpsControl, MpsGpu
from cgpud.node.procmap import ProcessMapper
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.signals import StopSignals


def private_state_dir(path: Path) -> None:
    """The instance tables and regions are root's alone (0700); an older
    cgpud made the directory 0755. Containers reach the files they need
    through bind mounts, which do not cross this directory's mode."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_mode & 0o077:
            path.chmod(0o700)
    except OSError as e:
        raise CgpuError(f"cannot prepare the state directory {path}: {e.strerror}") from e


def sweep_loop(
    service: InstanceService,
    interval: float,
    stop: threading.Event,
    also: Sequence[Callable[[], object]] = (),
    stats: DaemonStats | None = None,
    heartbeat: Heartbeat | None = None,
) -> None:
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


class Daemon:
    """One cgpud. start() brings every part up, stop() takes them down in
    the reverse order; wait() blocks until SIGTERM or SIGINT."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self._stack = ExitStack()
        self._signals: StopSignals | None = None
        self._notifier = Notifier.from_env()
        self._log = structlog.get_logger("cgpud")

    def start(self) -> None:
        with ExitStack() as stack:
            self._start(stack)
            self._stack = stack.pop_all()

    def wait(self) -> None:
        assert self._signals is not None, "start() first"
        self._signals.wait()

    def stop(self) -> None:
        self._notifier.stopping()
        self._log.info("stopping")
        self.stop_event.set()  # every loop's wait ends with it
        self._stack.close()

    def _start(self, stack: ExitStack) -> None:
        config, stop = self.config, self.stop_event
        # Refused before anything starts: a keep-alive period too short for the sweep.
        max_age = heartbeat_max_age(self._notifier, config.sweep_interval)
        inventory = read_inventory()
        mig_nodes = mig_devices.capability_map(inventory.gpus) if config.mig_share else {}
        gpus = capacities(inventory, gpu_node, config.mig_share, mig_nodes)
        private_state_dir(config.state_dir)
        store = Store(config.database)
        stack.callback(store.close)
        policy = config.policy()
        cluster = None
        if config.orchestrator is Orchestrator.KUBERNETES or config.capacity_listen:
            from cgpud.daemon.cluster import ClusterParts  # a fifth of a start: only where used

            cluster = ClusterParts(config)
            policy = cluster.initial_policy(policy)
        start_compute = (lambda: ComputeScheduler(len(gpus), config.timing()).start()) if gpus else None
        compute = start_compute() if start_compute and limits_compute(policy.mode) else None
        mps = None
        if policy.mode is NodeMode.MPS and gpus:  # before any instance: the GPUs exclusive to MPS first
            mps = MpsControl(config.socket.parent / "mps", [MpsGpu(g.index, g.uuid) for g in gpus])
            mps.start()
            stack.callback(mps.stop)
            stack.callback(mps.watch(stop).join, 5)
        exits = ExitWatch()
        service = InstanceService(
            store,
            gpus,
            policy,
            config.regions,
            inventory.driver_version,
            host.boot_id(),
            compute=compute,
            tmpfs_regions=True,
            start_compute=start_compute,
            reservation_ttl=config.reservation_ttl,
            exits=exits,
            links=inventory.links(),
            mps_pipes=mps.pipes() if mps is not None else None,
        )
        stack.callback(service.stop_compute)
        stack.callback(exits.start(service.init_exited, stop).join, 2)
        stats = DaemonStats()
        stats.timed("reconcile", service.reconcile)
        service.refill_region_spare()
        stack.callback(service.drop_region_spare)
        events = BypassEvents()
        bypass = self._bypass_watchdog(stack, service, gpus, events, stats)
        if config.metrics_listen:
            from cgpud.daemon.metrics import serve_metrics  # prometheus_client: only where scraped

            metrics = serve_metrics(
                config.metrics_listen,
                service,
                stats,
                __version__,
                {g.index: g.name for g in inventory.gpus} | _mig_models(inventory, gpus),
                events=events,
            )
            stack.callback(metrics.stop)
        files = runtime_files.install_runtime_files(config.state_dir, config.relay_socket)
        trust_env = config.orchestrator is Orchestrator.STANDALONE
        relay = RelayServer(
            ContainerLifecycle(service, files, trust_env),
            config.relay_socket,
            on_request=lambda verb, code: stats.request("relay", verb, code),
        ).start()
        stack.callback(relay.stop)
        server = serve(
            service,
            config.socket,
            cdi_spec=lambda: cdi.render(service, files, config.dev_root),
            on_request=lambda method, code: stats.request("admin", method, code),
            events=events,
            watching=_bypass_watching(config, bypass),
        )
        stack.callback(lambda: server.stop(grace=2).wait())
        self._signals = StopSignals(stop)
        stack.callback(self._signals.close)
        # Old versions' runtime files go once no active instance uses them.
        also: list[Callable[[], object]] = [
            lambda: runtime_files.collect(service, files, runtime_files.runtime_root(config.state_dir))
        ]
        if cluster is not None:
            also += cluster.start(stack, stop, service, inventory, gpus, policy, files, stats)
        # Pings vouch for the sweep loop: it touches the store, the instance
        # table and the kubelet/API server clients every round.
        heartbeat = Heartbeat()
        threading.Thread(
            target=sweep_loop, args=(service, config.sweep_interval, stop, also, stats, heartbeat), daemon=True
        ).start()
        if bypass is not None:  # its wait ends with `stop`; a round under way finishes first
            stack.callback(bypass.start(stop).join, config.bypass_interval + 10)
        start_keepalive(self._notifier, stop, healthy=None if max_age is None else lambda: heartbeat.fresh(max_age))
        self._notifier.ready()  # only now: reconciled and serving
        self._log.info(
            "ready",
            socket=str(config.socket),
            gpus=len(gpus),
            mode=policy.mode.value,
            bypass_interval=config.bypass_interval if bypass is not None else 0,
            bypass_action=config.bypass_action.value,
        )

    def _bypass_watchdog(
        self,
        stack: ExitStack,
        service: InstanceService,
        gpus: Sequence[GpuCapacity],
        events: BypassEvents,
        stats: DaemonStats,
    ) -> BypassWatchdog | None:
        """The bypass watchdog, not started; None when bypass_interval is 0
        or there is no GPU. It is built whatever the mode: node labels may
        turn an isolating mode on later, and until then its rounds only read
        the policy."""
        config = self.config
        # Not a GPU in MIG mode: cgpu has no instance there, and its processes
        # are the MIG devices' (pods given them whole), not tenants going around libcgpu.
        # Nor a MIG device taken as a GPU (mig_share): NVML lists its processes on its GPU, not by its index.
        watched = [g.index for g in gpus if not g.mig and g.parent < 0]
        if config.bypass_interval <= 0 or not watched:
            return None
        reader = NvmlProcessReader(watched, config.bypass_compute_window)
        stack.callback(reader.close)
        mapper = ProcessMapper()
        stack.callback(mapper.close)  # after the watchdog's thread ends (pushed later, so joined first)
        return BypassWatchdog(
            service,
            events,
            reader,
            mapper,
            config.watch_settings(),
            config.bypass_action,
            config.bypass_interval,
            stats=stats,
        )


def _mig_models(inventory: Inventory, gpus: Sequence[GpuCapacity]) -> dict[int, str]:
    """The metrics' model of each MIG device taken as a GPU (mig_share)."""
    names = {m.uuid: f"{g.name} MIG {m.profile}" for g in inventory.gpus for m in g.mig_devices}
    return {g.index: names.get(g.uuid, "") for g in gpus if g.parent >= 0}


def _bypass_watching(config: DaemonConfig, watchdog: BypassWatchdog | None) -> Callable[[], tuple[bool, str]]:
    """Whether the bypass watchdog looks now, and why not, for the admin API."""
    if watchdog is not None:
        return watchdog.watching
    reason = "bypass_interval is 0" if config.bypass_interval <= 0 else "this node has no GPU"
    return lambda: (False, reason)
