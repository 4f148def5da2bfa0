"""What counts as going around libcgpu, decided from what NVML lists and
whose each process is. Pure: no I/O, no clock; the loop (watchdog.py)
reads NVML and /proc (procmap.py) and acts on the answer."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatchcase

from cgpud.node.bypass_model import AllowRule, ComputeView, GpuProcess, ProcessIdentity, Violation, ViolationKind
from cgpud.node.bypass_model import WatchSettings
from cgpud.node.model import Instance
from cgpud.errors import UsageError
from cgpud.units import format_memory

_KINDS = ("cgroup", "exe")
_FORMS = (
    "cgroup:<glob> (the process's cgroup path, e.g. cgroup:/system.slice/dcgm*) or exe:<glob> "
    "(its executable as cgpud reads it, e.g. exe:/usr/bin/nv-hostengine)"
)

# Processes of the node itself that hold GPU memory with no instance. Any
# directory: distributions and the NVIDIA installer put them in different
# places, and a tenant cannot choose its exe path on the host.
DEFAULT_ALLOW: tuple[AllowRule, ...] = tuple(
    AllowRule("exe", f"*/{name}")
    for name in (
        "nvidia-persistenced",
        "nvidia-cuda-mps-server",
        "nvidia-cuda-mps-control",
        "nv-hostengine",
        "dcgm-exporter",
        "Xorg",
        "Xwayland",
    )
)


def parse_allow(text: str) -> tuple[AllowRule, ...]:
    """Allow rules written as in the bypass_allow setting: space separated
    `cgroup:<glob>` and `exe:<glob>` entries."""
    rules = []
    for entry in text.split():
        kind, sep, pattern = entry.partition(":")
        if not sep or kind not in _KINDS or not pattern:
            raise UsageError(f"bad bypass allow rule {entry!r}: write {_FORMS}")
        if not pattern.startswith(("/", "*")):
            raise UsageError(
                f"bad bypass allow rule {entry!r}: the pattern is a path from / (or starts with *); write {_FORMS}"
            )
        rules.append(AllowRule(kind, pattern))
    return tuple(rules)


def allowed(identity: ProcessIdentity, rules: Iterable[AllowRule]) -> bool:
    """The process may use a GPU with no instance. A field cgpud could not
    read ("") matches no rule, so an unreadable process is never allowed;
    an exe rule names a host path, so it never matches a process in another
    root (a container's image can put any name at /usr/bin/Xorg)."""
    for rule in rules:
        if rule.kind == "exe":
            value = identity.exe if identity.host_root else ""
        else:
            value = identity.cgroup if rule.kind == "cgroup" else ""
        if value and fnmatchcase(value, rule.pattern):
            return True
    return False


def decide(
    instances: Sequence[Instance],
    processes: Sequence[GpuProcess],
    identities: Mapping[int, ProcessIdentity],
    compute: Sequence[ComputeView],
    settings: WatchSettings,
) -> list[Violation]:
    """Every violation in one round, sorted (kind, instance, GPU, pids).

    Memory: per (instance, GPU), what its processes hold there (used None
    counts 0) above its grant there (0 on a GPU it has no grant on) plus
    memory_slack_bytes per process of it there (for memory_slack_processes
    of them at most). Unknown (isolating nodes
    only): each process of no active instance that the allow rules do not
    name; one that vanished before it was identified is skipped. Compute:
    per capped view, the instance's summed sm_percent on the GPU above the
    larger of its share and the engine's own charge, plus the excess.
    Instances that do not enforce (share mode's bookkeeping) and whole-GPU
    grants have no limit to go around."""
    active = {i.id: i for i in instances if i.active}
    mine: dict[tuple[str, int], list[GpuProcess]] = defaultdict(list)
    out: list[Violation] = []
    for p in processes:
        identity = identities.get(p.pid)
        if identity is None:
            continue  # gone before cgpud could look: nothing left to report or kill
        if identity.instance_id in active:
            mine[(identity.instance_id, p.gpu_index)].append(p)
        elif settings.isolating and not allowed(identity, settings.allow):
            out.append(_unknown(p, identity))
    for (iid, gpu), procs in mine.items():
        v = _memory(active[iid], gpu, procs, settings.memory_slack_bytes, settings.memory_slack_processes)
        if v is not None:
            out.append(v)
    for view in compute:
        if not view.caps or view.instance_id not in active or not active[view.instance_id].enforced:
            continue
        v = _compute(view, mine.get((view.instance_id, view.gpu_index), []), settings.compute_excess_percent)
        if v is not None:
            out.append(v)
    return sorted(out, key=lambda v: (v.kind.value, v.instance_id, v.gpu_index, v.pids))


def _pids(procs: Iterable[GpuProcess]) -> tuple[int, ...]:
    return tuple(sorted({p.pid for p in procs}))


def _unknown(p: GpuProcess, identity: ProcessIdentity) -> Violation:
    used = p.used_bytes or 0
    what = identity.exe or "an unreadable executable"
    where = f" in cgroup {identity.cgroup}" if identity.cgroup else ""
    detail = f"pid {p.pid} ({what}{where}) holds {format_memory(used)} on GPU {p.gpu_index} and belongs to no instance"
    return Violation(ViolationKind.UNKNOWN_PROCESS, p.gpu_index, "", (p.pid,), used_bytes=used, detail=detail)


def _memory(inst: Instance, gpu: int, procs: list[GpuProcess], slack: int, slack_processes: int) -> Violation | None:
    grant = next((g for g in inst.grants if g.gpu_index == gpu), None)
    if not inst.enforced or (grant is not None and grant.memory == 0):
        return None
    limit = grant.memory if grant is not None else 0
    pids = _pids(procs)
    used = sum(p.used_bytes or 0 for p in procs)
    if used <= limit + slack * min(len(pids), slack_processes):
        return None
    where = f"a limit of {format_memory(limit)}" if grant is not None else "no grant there"
    noun = "process" if len(pids) == 1 else "processes"
    detail = (
        f"instance {inst.id} holds {format_memory(used)} on GPU {gpu} in {len(pids)} {noun} "
        f"({', '.join(map(str, pids))}) with {where} (+ {format_memory(slack)} slack per process, "
        f"for at most {slack_processes})"
    )
    return Violation(
        ViolationKind.MEMORY_OVER_LIMIT, gpu, inst.id, pids, used_bytes=used, limit_bytes=limit, detail=detail
    )


def _compute(view: ComputeView, procs: list[GpuProcess], excess: float) -> Violation | None:
    samples = [p.sm_percent for p in procs if p.sm_percent is not None]
    if not samples:
        return None  # no utilisation data for its processes: nothing measured
    measured = sum(samples)
    allowed_percent = max(float(view.share_percent), view.engine_percent or 0.0)
    if measured <= allowed_percent + excess:
        return None
    pids = _pids(procs)
    detail = (
        f"instance {view.instance_id} used {measured:.0f}% of GPU {view.gpu_index}'s SMs "
        f"({', '.join(map(str, pids))}) where it may use {allowed_percent:.0f}% "
        f"(+ {excess:.0f} points)"
    )
    return Violation(
        ViolationKind.COMPUTE_OVER_SHARE,
        view.gpu_index,
        view.instance_id,
        pids,
        measured_percent=measured,
        allowed_percent=allowed_percent,
        detail=detail,
    )
