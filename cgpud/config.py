"""cgpud's settings: one dataclass from which the TOML keys, the command-line
flags and their help are all derived, so a setting is written down once.
Defaults the daemon's vocabulary (model.py) or the C scheduler core already
state are taken from there, and the core's limits come from its header."""

from __future__ import annotations

import argparse
import tomllib
import typing
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from cgpud._scheduler import lib as _sched
from cgpud.api import DEFAULT_SOCKET
from cgpud.api.listen import parse_endpoint, plaintext_problem, tls_problem
from cgpud.contract import ENV_PREFIX, RELAY_DEFAULT_SOCKET
from cgpud.node.bypass_model import AllowRule, BypassAction, WatchSettings
from cgpud.kube.mig import MigStrategy
from cgpud.node.model import MAX_SCHEDULED, ComputePolicy, ComputeTiming, NodeMode, NodePolicy, Orchestrator, Placement
from cgpud.node.model import isolates
from cgpud.node.compute_policy import decode_compute_policies
from cgpud.node.bypass_policy import DEFAULT_ALLOW, parse_allow
from cgpud.errors import UsageError
from cgpud.kube.health_policy import DEFAULT_PROBE_INTERVAL, DEFAULT_RECOVERY_WINDOW, HealthPolicy, parse_xids
from cgpud.kube.model import (
    DEFAULT_CDI_DIR,
    DEFAULT_DEVICE_PLUGIN_DIR,
    DEFAULT_MIN_POD_PRIORITY,
    DEFAULT_POD_RESOURCES_SOCKET,
)
from cgpud.units import MIB

DEFAULT_CONFIG = Path("/etc/cgpu/config.toml")
_MS = 1e6  # ns
PERIOD_MS = (_sched.CGPU_SCHED_MIN_PERIOD_NS / _MS, _sched.CGPU_SCHED_MAX_PERIOD_NS / _MS)
# The soft policy's bound (a lent share must come back within 100 ms); cgpud
# holds every policy's slice to it.
SLICE_MS = (_sched.CGPU_SCHED_MIN_SLICE_NS / _MS, _sched.CGPU_SCHED_SOFT_MAX_SLICE_NS / _MS)
_NODE = NodePolicy()
_TIMING = ComputeTiming()


def _range(bounds: tuple[float, float]) -> str:
    return f"{bounds[0]:g}-{bounds[1]:g}"


def _setting(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class DaemonConfig:
    mode: NodeMode = _setting(_NODE.mode, "node mode: default, share, cgpu, core_mem, mps or topology")
    placement: Placement = _setting(_NODE.placement, "binpack (fill one GPU first) or spread")
    max_instances_per_gpu: int = _setting(_NODE.max_instances_per_gpu, "instances one GPU may hold")
    core_step: int = _setting(_NODE.core_step, "compute shares are multiples of this percentage (1-100)")
    compute_policy: ComputePolicy = _setting(
        _NODE.compute_policy, ", ".join(f"{int(p)} {p.name.lower()}" for p in ComputePolicy)
    )
    gpu_compute_policy: str = _setting(
        "", 'GPUs whose compute policy differs from compute_policy, as index=policy pairs: "1=5 2=3"'
    )
    compute_period_ms: float = _setting(
        _TIMING.period_ns / _MS, f"compute scheduling period: shares hold within each period ({_range(PERIOD_MS)} ms)"
    )
    compute_slice_ms: float = _setting(
        _TIMING.max_slice_ns / _MS,
        f"longest time one instance holds a GPU before the scheduler decides again ({_range(SLICE_MS)} ms)",
    )
    high_priority_percent: int = _setting(
        _TIMING.high_priority_percent,
        "share of each period high-priority instances may take ahead of the others (0-100)",
    )
    fixed_windows: bool = _setting(
        _TIMING.fixed_windows,
        "under the fixed policy, each instance keeps to its own window of every period by itself, as while cgpud "
        "is away: cgpud hands out no slices (far less of its CPU; its grants and charged time stay still, the "
        "paced time is tenant-reported)",
    )
    busy_windows: bool = _setting(
        _TIMING.busy_windows,
        "under the fair, preemptive and weighted policies, while every instance keeps the GPU busy in its turn, "
        "each keeps to its equal (weighted) window by itself and cgpud hands out no slices, until one leaves its "
        "window idle (far less of cgpud's CPU with many busy instances)",
    )
    state_dir: Path = _setting(Path("/var/lib/cgpud"), "instance table and instance regions")
    socket: Path = _setting(DEFAULT_SOCKET, "local API socket (root only)")
    relay_socket: Path = _setting(
        Path(RELAY_DEFAULT_SOCKET), "socket cgpu-runtime and cgpu-hook talk to on the container start path"
    )
    orchestrator: Orchestrator = _setting(
        Orchestrator.STANDALONE,
        f"standalone (containers may ask with {ENV_PREFIX}_* env) "
        "or kubernetes (only the device plugin's requests count)",
    )
    sweep_interval: float = _setting(2.0, "seconds between checks for instances whose processes exited")
    device_plugin_dir: Path = _setting(
        Path(DEFAULT_DEVICE_PLUGIN_DIR),
        "the kubelet's device-plugins directory: cgpud serves its device plugin sockets there and registers with "
        "its kubelet.sock (orchestrator kubernetes)",
    )
    mig_strategy: MigStrategy = _setting(
        MigStrategy.NONE,
        "MIG devices to the kubelet, as NVIDIA's device plugin: none, single (each MIG device one nvidia.com/gpu; "
        "all alike) or mixed (nvidia.com/mig-<profile>); docs/kubernetes.md (orchestrator kubernetes)",
    )
    mig_share: bool = _setting(
        False,
        "each MIG device is one of the node's GPUs, shared as the node mode shares GPUs (memory limits within "
        "the instance's memory); mig_strategy then serves none; docs/modes.md",
    )
    pod_resources_socket: Path = _setting(
        Path(DEFAULT_POD_RESOURCES_SOCKET),
        "the kubelet's pod-resources socket: which pods still hold devices (orchestrator kubernetes)",
    )
    gpu_health_probe_interval: float = _setting(
        DEFAULT_PROBE_INTERVAL, "seconds between NVML probes of every GPU for its device plugin health (0.1-3600)"
    )
    gpu_health_skip_xids: str = _setting(
        "", 'XIDs that leave a GPU Healthy besides NVIDIA\'s application ones (13 31 43 45 68 109): "48 94"'
    )
    gpu_health_recovery_window: float = _setting(
        DEFAULT_RECOVERY_WINDOW, "seconds with no fatal XID after which a GPU is Healthy again (0: only a reset)"
    )
    node_name: str = _setting(
        "", "this node's name in the cluster (orchestrator kubernetes): empty means $NODE_NAME, else the host name"
    )
    kubeconfig: str = _setting(
        "", "kubeconfig file for the API server (orchestrator kubernetes); empty means the pod's service account"
    )
    cdi_dir: Path = _setting(
        Path(DEFAULT_CDI_DIR), "where cgpud writes the CDI specs of pod instances (orchestrator kubernetes)"
    )
    dev_root: Path = _setting(
        Path("/"),
        "where the driver's device nodes are: ROOT/dev/nvidia* (a driver container's, e.g. /run/nvidia/driver); "
        "containers get them at /dev/nvidia*",
    )
    capacity_listen: str = _setting(
        "", "HOST:PORT of the Capacity API for cluster schedulers (IPv6 in brackets); empty: not served"
    )
    capacity_tls_cert: str = _setting("", "the Capacity API's server certificate (PEM); TLS needs all three files")
    capacity_tls_key: str = _setting("", "the key of capacity_tls_cert (PEM)")
    capacity_tls_ca: str = _setting(
        "", "CA (PEM) every Capacity API client's certificate must chain to: client certificates are required"
    )
    capacity_insecure: bool = _setting(
        False, "serve the Capacity API in plaintext on a non-loopback address (without TLS files)"
    )
    capacity_advertise: str = _setting(
        "",
        "HOST:PORT written on the Node for cgpu-scheduler (orchestrator kubernetes); empty: the listen address, "
        "or the node's primary address when listening on every address",
    )
    pod_share_priority_min: int = _setting(
        DEFAULT_MIN_POD_PRIORITY,
        "lowest Kubernetes pod priority (spec.priority, from a PriorityClass) whose containers may ask for a "
        f"compute weight or high priority ({ENV_PREFIX}_SCHD_WEIGHT, {ENV_PREFIX}_HIGH_PRIO, cgpu.io/gpu-weight, "
        "cgpu.io/gpu-high-priority); others that ask are refused at Allocate (orchestrator kubernetes)",
    )
    reservation_ttl: float = _setting(
        120.0, "seconds a Capacity reservation holds unless its Reserve says otherwise (1-3600)"
    )
    metrics_listen: str = _setting(
        "", "HOST:PORT where cgpud serves Prometheus metrics at /metrics (IPv6 in brackets); empty: not served"
    )
    bypass_interval: float = _setting(
        1.0,
        "seconds between rounds of the bypass watchdog, which finds processes going around libcgpu through "
        "NVML (0.1-60; 0: off); it watches only in modes that isolate (cgpu, core_mem, mps)",
    )
    bypass_action: BypassAction = _setting(
        BypassAction.REPORT,
        "what the bypass watchdog does about an instance's offending processes: report, or kill "
        "(SIGKILL; a process of no instance is only reported unless bypass_kill_unknown)",
    )
    bypass_kill_unknown: bool = _setting(
        False,
        "with bypass_action kill, also SIGKILL processes on a GPU that belong to no instance and are not on "
        "bypass_allow (put every daemon and tool of the node that uses GPUs on bypass_allow first)",
    )
    bypass_memory_slack_mib: int = _setting(
        512,
        "MiB each of an instance's processes on a GPU may hold past its limit there before the watchdog counts "
        "it (the driver's context memory, which libcgpu does not charge; 0-65536)",
    )
    bypass_memory_slack_processes: int = _setting(
        4,
        "processes of an instance on a GPU the memory slack is given for, at most: a tenant that forks more "
        "gains nothing (1-1024)",
    )
    bypass_allow: str = _setting(
        "",
        "processes that may use a GPU without an instance, besides NVIDIA's daemons: space-separated "
        'cgroup:GLOB or exe:GLOB, "cgroup:/system.slice/dcgm* exe:/usr/bin/nv-hostengine"',
    )
    bypass_compute_window: float = _setting(
        5.0, "seconds of NVML utilisation samples the watchdog's compute rule averages (1-600)"
    )
    bypass_compute_excess_percent: float = _setting(
        20.0, "points of GPU time above its share (fixed and soft policies) before an instance's use counts (1-100)"
    )

    def policy(self) -> NodePolicy:
        node = NodePolicy(self.mode, self.placement, self.max_instances_per_gpu, self.core_step, self.compute_policy)
        return decode_compute_policies(node, f"{int(self.compute_policy)} {self.gpu_compute_policy}")

    def health_policy(self) -> HealthPolicy:
        return HealthPolicy.build(parse_xids(self.gpu_health_skip_xids), self.gpu_health_recovery_window)

    def timing(self) -> ComputeTiming:
        return ComputeTiming(
            round(self.compute_period_ms * 1e6),
            round(self.compute_slice_ms * 1e6),
            self.high_priority_percent,
            self.fixed_windows,
            self.busy_windows,
        )

    def allow_rules(self) -> tuple[AllowRule, ...]:
        return (*DEFAULT_ALLOW, *parse_allow(self.bypass_allow))

    def watch_settings(self) -> WatchSettings:
        """The bypass watchdog's rule settings; `isolating` follows the mode
        of each round (node labels may change it)."""
        return WatchSettings(
            self.bypass_memory_slack_mib * MIB,
            self.bypass_compute_excess_percent,
            self.allow_rules(),
            isolating=isolates(self.mode),
            memory_slack_processes=self.bypass_memory_slack_processes,
            kill_unknown=self.bypass_kill_unknown,
        )

    @property
    def database(self) -> Path:
        return self.state_dir / "cgpud.db"

    @property
    def regions(self) -> Path:
        return self.state_dir / "instances"


def _convert(name: str, kind: type, value: Any) -> Any:
    try:
        if isinstance(kind, type) and issubclass(kind, Enum):
            return kind(int(value)) if issubclass(kind, int) else kind(str(value))
        if kind is Path:
            return Path(str(value))
        if kind is str and isinstance(value, str):
            return value
        if kind is int and not isinstance(value, bool):
            return int(value)
        if kind is float and not isinstance(value, bool):
            return float(value)
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _BOOLS:
                return _BOOLS[value.strip().lower()]
    except (TypeError, ValueError):
        pass
    choices = (
        f" (one of: {', '.join(str(m.value) for m in kind)})"
        if isinstance(kind, type) and issubclass(kind, Enum)
        else ""
    )
    raise UsageError(f"setting {name} = {value!r} is not valid{choices}")


_BOOLS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}


def _types() -> dict[str, type]:
    return typing.get_type_hints(DaemonConfig)


# Settings whose values lie in a closed range: (lowest, highest, the unit the message gives them in).
_BOUNDS: dict[str, tuple[float, float, str]] = {
    "max_instances_per_gpu": (1, 1000, ""),
    "core_step": (1, 100, ""),
    "compute_period_ms": (*PERIOD_MS, ""),
    "high_priority_percent": (0, 100, ""),
    "sweep_interval": (0.1, 3600, " seconds"),
    "gpu_health_probe_interval": (0.1, 3600, " seconds"),
    "reservation_ttl": (1, 3600, " seconds"),
    # Kubernetes' own range of pod priorities.
    "pod_share_priority_min": (-(2**31), 2**31 - 1, ""),
    "bypass_memory_slack_mib": (0, 65536, ""),
    "bypass_memory_slack_processes": (1, 1024, ""),
    "bypass_compute_window": (1, 600, " seconds"),
    "bypass_compute_excess_percent": (1, 100, ""),
}


def validate(config: DaemonConfig) -> DaemonConfig:
    for name, (low, high, unit) in _BOUNDS.items():
        if not low <= getattr(config, name) <= high:
            raise UsageError(f"{name} must be between {low:g} and {high:g}{unit}")
    if config.mode is NodeMode.CORE_MEM and config.max_instances_per_gpu > MAX_SCHEDULED:
        raise UsageError(
            f"max_instances_per_gpu must be at most {MAX_SCHEDULED} in core_mem mode "
            "(the instances the compute scheduler takes per GPU)"
        )
    config.policy()  # a bad gpu_compute_policy is refused at start, not at the first request
    if not SLICE_MS[0] <= config.compute_slice_ms <= min(SLICE_MS[1], config.compute_period_ms):
        raise UsageError(
            f"compute_slice_ms must be between {SLICE_MS[0]:g} and {SLICE_MS[1]:g}, "
            "and not longer than compute_period_ms"
        )
    config.health_policy()  # bad XIDs or a negative window are refused at start
    if not config.dev_root.is_absolute():
        raise UsageError(f"dev_root must be an absolute path, not {str(config.dev_root)!r}")
    _validate_capacity(config)
    if config.metrics_listen:
        parse_endpoint(config.metrics_listen, "metrics_listen")
    _validate_bypass(config)
    return config


def _validate_bypass(config: DaemonConfig) -> None:
    if config.bypass_interval != 0 and not 0.1 <= config.bypass_interval <= 60:
        raise UsageError("bypass_interval must be 0 (off) or between 0.1 and 60 seconds")
    config.allow_rules()  # a bad allow rule is refused at start, with the entry named


def _validate_capacity(config: DaemonConfig) -> None:
    """The Capacity settings as serve_capacity will take them, refused at
    start rather than after the daemon is half up."""
    problem = tls_problem(config.capacity_tls_cert, config.capacity_tls_key, config.capacity_tls_ca)
    if problem is None and config.capacity_advertise:
        parse_endpoint(config.capacity_advertise, "capacity_advertise", port_optional=True)
    if problem is None and config.capacity_listen:
        problem = plaintext_problem(
            parse_endpoint(config.capacity_listen, "capacity_listen"),
            bool(config.capacity_tls_cert),
            config.capacity_insecure,
        )
    if problem is not None:
        raise UsageError(problem)


def load(path: Path | None, overrides: dict[str, Any]) -> DaemonConfig:
    """The file (missing is fine only for the default path), then flags."""
    values: dict[str, Any] = {}
    source = path or DEFAULT_CONFIG
    try:
        values = tomllib.loads(source.read_text())
    except FileNotFoundError:
        if path is not None:
            raise UsageError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file {source} is not valid TOML: {e}") from e
    except OSError as e:
        raise UsageError(f"cannot read config file {source}: {e.strerror}") from e
    kinds = _types()
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise UsageError(f"config file {source}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(kinds))})")
    values.update({k: v for k, v in overrides.items() if v is not None})
    converted = {k: _convert(k, kinds[k], v) for k, v in values.items()}
    return validate(replace(DaemonConfig(), **converted))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting, named and documented from the dataclass."""
    parser.add_argument("--config", type=Path, help=f"settings file (default {DEFAULT_CONFIG}, if present)")
    kinds = _types()
    for f in fields(DaemonConfig):
        # A bool flag alone means true; "--flag false" still says no.
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if kinds[f.name] is bool else {}
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} (default {getattr(f.default, 'value', f.default)})",
            **extra,
        )


def from_arguments(args: argparse.Namespace) -> DaemonConfig:
    return load(args.config, {f.name: getattr(args, f.name) for f in fields(DaemonConfig)})
