"""The GPU health decision, pure: which XIDs are fatal, and one GPU's
verdict after each observation (an XID, a probe). cgpud.kube.health watches
NVML and feeds it; the settings (cgpud.config) build its policy."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from cgpud.errors import UsageError

# XIDs that say an application failed, not the GPU (NVIDIA k8s-device-plugin).
DEFAULT_SKIPPED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# A GPU with a fatal XID and no further one for this long is trusted again:
# long enough that a GPU failing every job that retries on it stays out,
# short enough that one transient XID does not strand a GPU until a reboot.
DEFAULT_RECOVERY_WINDOW = 300.0
DEFAULT_PROBE_INTERVAL = 5.0
DEFAULT_WAIT_MS = 1000

XID_NAMES = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


class GpuRef(Protocol):
    """A GPU as the inventory names it (cgpud.node.inventory.Gpu is one)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...


def parse_xids(text: str) -> frozenset[int]:
    """XIDs written as a setting: numbers separated by spaces or commas."""
    words = text.replace(",", " ").split()
    bad = [w for w in words if not w.isdigit() or not 1 <= int(w) <= 999]
    if bad:
        raise UsageError(f"XIDs must be numbers from 1 to 999 separated by spaces or commas; {bad[0]!r} is not")
    return frozenset(int(w) for w in words)


@dataclass(frozen=True)
class HealthPolicy:
    skipped_xids: frozenset[int] = DEFAULT_SKIPPED_XIDS
    recovery_window: float = DEFAULT_RECOVERY_WINDOW  # seconds; 0: only a reset recovers

    @classmethod
    def build(cls, extra_skipped: Iterable[int] = (), recovery_window: float = DEFAULT_RECOVERY_WINDOW) -> HealthPolicy:
        """NVIDIA's skipped XIDs plus `extra_skipped`."""
        extra = frozenset(extra_skipped)
        bad = sorted(x for x in extra if not 1 <= x <= 999)
        if bad:
            raise UsageError(f"XIDs to skip must be between 1 and 999, got {bad}")
        if recovery_window < 0:
            raise UsageError(f"the XID recovery window must be 0 (reset only) or more seconds, got {recovery_window}")
        return cls(DEFAULT_SKIPPED_XIDS | extra, recovery_window)

    def fatal(self, xid: int) -> bool:
        return xid not in self.skipped_xids


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's verdict (healthy, reason) and what the decision remembers."""

    index: int
    uuid: str
    healthy: bool = True
    reason: str = ""  # why not healthy; "" when healthy
    changed_at: float = 0.0  # monotonic seconds when the verdict last changed
    lost: bool = False  # the last probe failed with GPU_IS_LOST
    unreachable: str = ""  # the last probe's failure other than lost
    fatal_xid: int | None = None
    fatal_xid_at: float = 0.0


@dataclass(frozen=True)
class XidObserved:
    index: int
    xid: int
    at: float


@dataclass(frozen=True)
class ProbeObserved:
    index: int
    at: float
    lost: bool = False
    failure: str = ""  # NVML's message when the probe failed otherwise

    @property
    def ok(self) -> bool:
        return not self.lost and not self.failure


Observation = XidObserved | ProbeObserved


XID_LOST = 79


def xid_text(xid: int) -> str:
    name = XID_NAMES.get(xid)
    return f"XID {xid} ({name})" if name else f"XID {xid}"


def _verdict(state: GpuHealth) -> str:
    if state.lost:
        return "GPU is lost"
    if state.unreachable:
        return f"NVML cannot query the GPU: {state.unreachable}"
    if state.fatal_xid is not None:
        return f"fatal {xid_text(state.fatal_xid)}"
    return ""


def decide(state: GpuHealth, obs: Observation, policy: HealthPolicy) -> GpuHealth:
    """The GPU's state after one observation of it."""
    if isinstance(obs, XidObserved):
        if policy.fatal(obs.xid):
            # XID 79 says the GPU left the bus: it is lost, and a probe that
            # answers again is its reset, even if no probe saw it gone.
            state = replace(state, fatal_xid=obs.xid, fatal_xid_at=obs.at, lost=state.lost or obs.xid == XID_LOST)
    elif obs.ok:
        # Back on the bus means the GPU was reset: its XIDs are history.
        if state.lost:
            state = replace(state, lost=False, unreachable="", fatal_xid=None, fatal_xid_at=0.0)
        else:
            state = replace(state, lost=False, unreachable="")
    else:
        state = replace(state, lost=obs.lost, unreachable="" if obs.lost else obs.failure)
    if (
        state.fatal_xid is not None
        and policy.recovery_window > 0
        and obs.at - state.fatal_xid_at >= policy.recovery_window
    ):
        state = replace(state, fatal_xid=None, fatal_xid_at=0.0)
    reason = _verdict(state)
    if reason != state.reason:
        state = replace(state, healthy=not reason, reason=reason, changed_at=obs.at)
    return state


def apply(snapshot: Mapping[int, GpuHealth], obs: Observation, policy: HealthPolicy) -> dict[int, GpuHealth]:
    """Every GPU's state after an observation (of one GPU; others unchanged).
    An observation of a GPU the snapshot lacks changes nothing."""
    out = dict(snapshot)
    if obs.index in out:
        out[obs.index] = decide(out[obs.index], obs, policy)
    return out


def healthy_by_index(snapshot: Mapping[int, GpuHealth]) -> dict[int, bool]:
    """The map DevicePlugin.update(health=...) takes."""
    return {i: h.healthy for i, h in snapshot.items()}
