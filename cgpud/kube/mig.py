"""Which MIG devices the node serves to the kubelet, under which resource,
and the labels NVIDIA's GPU feature discovery would put on the Node for
them. Pure functions over the inventory; the device plugin serves the
plan and the node agent writes the labels.

Strategies (setting `mig_strategy`), as NVIDIA's device plugin has them:

- `none`: MIG devices are not served. A GPU in MIG mode is not served
  either (NVIDIA's plugin serves it whole, which no CUDA process can use:
  cgpu leaves it out and says so).
- `single`: every GPU is in MIG mode and every MIG device is alike; each
  MIG device is one `nvidia.com/gpu` (on a `default` node). A node that is
  not so serves no MIG device and says why, in NVIDIA's words ("more than
  one MIG device type present on node"); GFD then labels the product
  `<product>-MIG-INVALID`, count and memory 0.
- `mixed`: each MIG device is one `nvidia.com/mig-<profile>` ("+" as ".":
  `1g.10gb+me` is `mig-1g.10gb.me`), in every node mode; GPUs outside MIG
  mode are served as the mode serves them.

Only MIG devices whose compute instance spans its GPU instance are served
(NVIDIA skips the others too)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from enum import Enum

from cgpud.errors import UsageError

if TYPE_CHECKING:  # annotations only: the inventory loads NVML's bindings
    from cgpud.node.inventory import Gpu, MigDevice

RESOURCE_GPU = "nvidia.com/gpu"
RESOURCE_PREFIX = "nvidia.com/mig-"
LABEL_CAPABLE = "nvidia.com/mig.capable"
LABEL_STRATEGY = "nvidia.com/mig.strategy"
LABEL_PRODUCT = "nvidia.com/gpu.product"
LABEL_COUNT = "nvidia.com/gpu.count"
LABEL_MEMORY = "nvidia.com/gpu.memory"


class MigStrategy(str, Enum):
    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


def parse_strategy(value: str) -> MigStrategy:
    try:
        return MigStrategy(value.strip())
    except ValueError:
        raise UsageError(f"unknown mig_strategy {value!r}: use none, single or mixed (NVIDIA's names)") from None


@dataclass(frozen=True)
class ServedMig:
    """A MIG device as one device of one extended resource."""

    resource: str
    device: MigDevice


@dataclass(frozen=True)
class MigPlan:
    """What a node serves of its MIG devices: `served`; `hidden` GPUs in MIG
    mode that are served as nothing whole; `problem` why MIG devices that
    exist are not served ("" when nothing is amiss)."""

    strategy: MigStrategy
    served: tuple[ServedMig, ...] = ()
    hidden: tuple[int, ...] = ()
    problem: str = ""

    def resources(self) -> tuple[str, ...]:
        """The MIG resources besides cgpu's own, sorted (nvidia.com/gpu is one of cgpu's)."""
        return tuple(sorted({s.resource for s in self.served} - {RESOURCE_GPU}))

    def by_uuid(self) -> dict[str, ServedMig]:
        return {s.device.uuid: s for s in self.served}


def resource_of(profile: str) -> str:
    return RESOURCE_PREFIX + profile.replace("+", ".")


def _whole_ci(m: MigDevice) -> bool:
    return m.ci_slices == m.gi_slices


def plan(strategy: MigStrategy, gpus: Sequence[Gpu], shared: bool = False) -> MigPlan:
    """`shared` (setting mig_share): the MIG devices are the node's GPUs
    (cgpud.node.inventory.capacities), served as its mode serves GPUs; none
    is served by the strategy."""
    mig_gpus = [g for g in gpus if g.mig_mode]
    hidden = tuple(g.index for g in mig_gpus)
    if shared:
        return MigPlan(strategy, hidden=hidden)
    devices = [m for g in mig_gpus for m in g.mig_devices]
    if strategy is MigStrategy.NONE:
        problem = (
            f"GPU {', '.join(map(str, hidden))} in MIG mode: mig_strategy none serves no MIG device "
            "(set mig_strategy to single or mixed, or disable MIG)"
            if hidden
            else ""
        )
        return MigPlan(strategy, hidden=hidden, problem=problem)
    usable = [m for m in devices if _whole_ci(m)]
    if strategy is MigStrategy.MIXED:
        served = tuple(ServedMig(resource_of(m.profile), m) for m in usable)
        skipped = len(devices) - len(usable)
        problem = (
            f"{skipped} MIG devices with a compute instance smaller than its GPU instance not served" if skipped else ""
        )
        return MigPlan(strategy, served, hidden, problem)
    problem = _single_problem(gpus, devices)
    if problem:
        return MigPlan(strategy, hidden=hidden, problem=problem)
    return MigPlan(strategy, tuple(ServedMig(RESOURCE_GPU, m) for m in devices), hidden)


def _single_problem(gpus: Sequence[Gpu], devices: Sequence[MigDevice]) -> str:
    modes = {g.mig_mode for g in gpus}
    if modes == {False} or not gpus:
        return ""  # no MIG: single is none
    if len(modes) > 1:
        return "devices with MIG enabled and disabled detected: mig_strategy single needs every GPU in MIG mode"
    if not devices:
        return "no MIG devices present on node"
    if not all(_whole_ci(m) for m in devices) or len({_shape(m) for m in devices}) > 1:
        return "more than one MIG device type present on node: use mig_strategy mixed"
    return ""


def _shape(m: MigDevice) -> tuple[object, ...]:
    return (m.profile, m.memory_total, m.sm_count, m.gi_slices, m.ci_slices, m.copy_engines, m.decoders)


def _product(gpus: Sequence[Gpu]) -> str:
    return gpus[0].name.replace(" ", "-") if gpus else ""


def _device_labels(prefix: str, m: MigDevice) -> dict[str, str]:
    return {
        f"{prefix}.memory": str(m.memory_total >> 20),
        f"{prefix}.multiprocessors": str(m.sm_count),
        f"{prefix}.slices.gi": str(m.gi_slices),
        f"{prefix}.slices.ci": str(m.ci_slices),
        f"{prefix}.engines.copy": str(m.copy_engines),
        f"{prefix}.engines.decoder": str(m.decoders),
        f"{prefix}.engines.encoder": str(m.encoders),
        f"{prefix}.engines.jpeg": str(m.jpegs),
        f"{prefix}.engines.ofa": str(m.ofas),
    }


def gfd_labels(strategy: MigStrategy, gpus: Sequence[Gpu], mig_capable: bool, shared: bool = False) -> dict[str, str]:
    """The MIG labels GPU feature discovery writes for this node's GPUs:
    `nvidia.com/mig.capable`, `nvidia.com/mig.strategy`, and per strategy
    single's overridden `nvidia.com/gpu.*` or mixed's `nvidia.com/mig-<profile>.*`
    (none of those when the MIG devices are shared: the strategy serves none)."""
    labels = {LABEL_CAPABLE: str(mig_capable).lower(), LABEL_STRATEGY: strategy.value}
    if shared:
        return labels
    p = plan(strategy, gpus)
    if strategy is MigStrategy.MIXED:
        counts = Counter(s.device.profile for s in p.served)
        first = {s.device.profile: s.device for s in reversed(p.served)}
        for profile, count in sorted(counts.items()):
            prefix = "nvidia.com/mig-" + profile
            labels[f"{prefix}.count"] = str(count)
            labels.update(_device_labels(prefix, first[profile]))
        return labels
    if strategy is MigStrategy.SINGLE and any(g.mig_mode for g in gpus):
        if p.problem:  # GFD's own tests: these three, nothing else
            labels[LABEL_PRODUCT] = f"{_product(gpus)}-MIG-INVALID"
            labels[LABEL_COUNT] = labels[LABEL_MEMORY] = "0"
            return labels
        m = p.served[0].device
        labels[LABEL_PRODUCT] = f"{_product(gpus)}-MIG-{m.profile}"
        labels[LABEL_COUNT] = str(len(p.served))
        labels.update(_device_labels("nvidia.com/gpu", m))
    return labels
