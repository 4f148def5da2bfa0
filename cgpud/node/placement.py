"""Admission and placement: which GPUs a request gets, or why it gets none.

Pure functions over the model (no I/O, no clock, no state), so the daemon,
the Capacity API and `cgpuctl inspect` all reach the same answer from the same
instance table, cgpu-scheduler the same answer from the node's Capacity view
(admit_usage), and every rule can be tested exhaustively.

Errors: UsageError when the request (or node setting) is wrong in itself and
would never be granted here; AdmissionError when it is well formed but does
not fit now. Each message is one line that says what was asked, what the
node has and what to change, in the words of ACK's resources and labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from cgpud.node import topology
from cgpud.node.topology import Links
from cgpud.node.model import GpuCapacity, GpuUsage, Grant, Instance, NodeMode, NodePolicy, Placement, Request
from cgpud.node.model import COMPUTE_SHARE_MODES, Reservation, Share, WHOLE_GPU_MODES
from cgpud.errors import AdmissionError, StateError, UsageError
from cgpud.units import format_memory

# A GPU's whole compute, in the percent units of aliyun.com/gpu-core.percentage.
_FULL_CORE = 100


# --------------------------------------------------------------------------
# Usage


def gpu_usage(
    gpus: Sequence[GpuCapacity],
    active: Iterable[Instance],
    reserved: Iterable[Reservation] = (),
    whole: Iterable[int] = (),
) -> tuple[GpuUsage, ...]:
    """What active instances and reservations hold of each GPU, in GPU index
    order. A reservation's share holds its memory, compute and instance
    slots as instances would; `reserved` are the live ones (the caller has
    the clock). `whole`: GPUs the kubelet has given pods whole
    (nvidia.com/gpu, aliyun.com/gpu), for which cgpud keeps no instance:
    each holds all of its GPU, as one instance.

    Released instances are skipped even if a caller passes them, so a stale
    list can never make the node look fuller than it is. Grants and shares on
    a GPU that is not in `gpus` (gone from the inventory) count nowhere:
    placement can only hand out GPUs that exist."""
    by_index: dict[int, GpuCapacity] = {}
    for gpu in gpus:
        if gpu.index in by_index:
            # An inventory bug, not a user error: two GPUs would share books.
            raise ValueError(f"GPU index {gpu.index} is listed twice")
        by_index[gpu.index] = gpu
    allocated = dict.fromkeys(by_index, 0)
    cores = dict.fromkeys(by_index, 0)
    counts = dict.fromkeys(by_index, 0)
    for inst in active:
        if not inst.active:
            continue
        seen: set[int] = set()
        for grant in inst.grants:
            if grant.gpu_index not in by_index:
                continue
            allocated[grant.gpu_index] += grant.memory
            cores[grant.gpu_index] += grant.core_percent
            # An instance is one instance on a GPU however its grants split.
            if grant.gpu_index not in seen:
                seen.add(grant.gpu_index)
                counts[grant.gpu_index] += 1
    held = tuple(
        GpuUsage(gpu=by_index[i], allocated=allocated[i], core_percent=cores[i], instances=counts[i])
        for i in sorted(by_index)
    )
    # A GPU in MIG mode is as taken as one a pod holds whole.
    taken = set(whole) | {i for i, g in by_index.items() if g.mig}
    pods = [Share(i, by_index[i].memory, _FULL_CORE) for i in sorted(taken) if i in by_index]
    return with_shares(held, [*(share for reservation in reserved for share in reservation.shares), *pods])


# --------------------------------------------------------------------------
# Admission


def admit(
    request: Request,
    gpus: Sequence[GpuCapacity],
    active: Sequence[Instance],
    policy: NodePolicy,
    reserved: Sequence[Reservation] = (),
    links: Links | None = None,
    whole: Iterable[int] = (),
) -> tuple[Grant, ...]:
    """The grants for `request`, one per GPU, sorted by GPU index, or an
    error saying why there are none. Same inputs, same answer. Every live
    reservation in `reserved` counts as taken, except the one of the pod
    the request draws on (request.reservation); so do the GPUs pods hold
    whole (`whole`, gpu_usage)."""
    others = [r for r in reserved if not request.reservation or r.pod_uid != request.reservation]
    return admit_usage(request, gpu_usage(gpus, active, others, whole), policy, links)


def admit_usage(
    request: Request, usage: Sequence[GpuUsage], policy: NodePolicy, links: Links | None = None
) -> tuple[Grant, ...]:
    """admit, on what is already held of each GPU: the node counts it from
    its instances and reservations, the cluster scheduler from the node's
    Capacity view, and both judge the request here. With `links` (how the
    GPUs are joined), whole GPUs in `topology` mode and every request for
    several GPUs take the best-joined set of those that fit
    (cgpud.node.topology) instead of placement's first."""
    mode, placement = check_policy(policy)
    _check_request(request, [u.gpu for u in usage], mode, policy)
    if request.gpu_indexes:  # a cluster scheduler chose them: those or none
        usage = tuple(u for u in usage if u.gpu.index in request.gpu_indexes)
    try:
        if mode in WHOLE_GPU_MODES:
            chosen = _whole_gpus(request, tuple(usage), placement, mode, links)
            grants = [Grant(u.gpu.index, u.gpu.uuid, u.gpu.memory, _FULL_CORE) for u in chosen]
        else:
            chosen = _shared_gpus(request, tuple(usage), placement, policy, links)
            grants = [Grant(u.gpu.index, u.gpu.uuid, request.memory, request.core_percent) for u in chosen]
    except AdmissionError as e:
        if not request.gpu_indexes:
            raise
        raise AdmissionError(f"the scheduler chose {_gpu_list(list(request.gpu_indexes))}: {e}") from None
    return tuple(sorted(grants, key=lambda g: g.gpu_index))


def admit_resize(
    instance: Instance,
    memory: int | None,
    core_percent: int | None,
    gpus: Sequence[GpuCapacity],
    active: Sequence[Instance],
    policy: NodePolicy,
    reserved: Sequence[Reservation] = (),
    whole: Iterable[int] = (),
) -> tuple[Grant, ...]:
    """The grants of a running `instance` with `memory` per GPU and
    `core_percent` (None: as it is now), on the GPUs it holds: the resized
    instance is judged as a request for those GPUs against everything else
    the node holds. What its processes use now is the caller's check."""
    mode, _ = check_policy(policy)
    if not instance.active:
        raise StateError(f"instance {instance.id} is {instance.state.value}: only a running instance can be resized")
    if mode in WHOLE_GPU_MODES:
        raise UsageError(f"node mode {mode.value} gives whole GPUs: instance {instance.id} has no share to resize")
    first = instance.grants[0]
    request = Request(
        owner=instance.owner,
        memory=first.memory if memory is None else memory,
        gpu_count=len(instance.grants),
        core_percent=first.core_percent if core_percent is None else core_percent,
        weight=instance.weight,
        priority=instance.priority,
        gpu_indexes=tuple(g.gpu_index for g in instance.grants),
    )
    grants = tuple(replace(g, memory=request.memory, core_percent=request.core_percent) for g in instance.grants)
    if grants == instance.grants:
        return grants
    if mode is NodeMode.MPS:
        # The MPS server fixed both when the client connected.
        if request.core_percent != first.core_percent:
            raise UsageError(
                f"instance {instance.id} is an MPS client: its thread percentage "
                "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) is fixed when it connects; restart it for another core share"
            )
        if request.memory > first.memory:
            raise UsageError(
                f"instance {instance.id} is an MPS client held to the pinned memory it started with "
                "(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT): on an mps node it can shrink, not grow; restart it to grow"
            )
    _check_request(request, gpus, mode, policy)
    others = [i for i in active if i.id != instance.id]
    usage = tuple(u for u in gpu_usage(gpus, others, reserved, whole) if u.gpu.index in request.gpu_indexes)
    try:
        _shared_gpus(request, usage, Placement.BINPACK, policy)
    except AdmissionError as e:
        core = f" with {request.core_percent}% compute" if request.core_percent else ""
        raise AdmissionError(
            f"cannot resize instance {instance.id} to {format_memory(request.memory)}{core} on "
            f"{_gpu_list(list(request.gpu_indexes))}: {e}"
        ) from None
    return grants


def with_shares(usage: Sequence[GpuUsage], shares: Iterable[Share]) -> tuple[GpuUsage, ...]:
    """`usage` once `shares` are held too: each share takes its memory,
    compute and instance slots, as a reservation's does in gpu_usage.
    Shares on a GPU not in `usage` count nowhere."""
    add: dict[int, tuple[int, int, int]] = {}
    for s in shares:
        m, c, n = add.get(s.gpu_index, (0, 0, 0))
        add[s.gpu_index] = (m + s.memory, c + s.core_percent, n + s.instances)
    if not add:
        return tuple(usage)
    out = []
    for u in usage:
        a = add.get(u.gpu.index)
        out.append(u if a is None else GpuUsage(u.gpu, u.allocated + a[0], u.core_percent + a[1], u.instances + a[2]))
    return tuple(out)


def parse_policy(mode: str, placement: str, core_step: int, max_instances_per_gpu: int) -> NodePolicy:
    """Node settings as another process reports them (a Capacity view's
    text), checked as admission checks its own: UsageError names what is
    wrong."""
    # The text goes in as it came, for check_policy to refuse what is not a mode or placement.
    raw = NodePolicy(
        mode=mode,  # type: ignore[arg-type]
        placement=placement,  # type: ignore[arg-type]
        core_step=core_step,
        max_instances_per_gpu=max_instances_per_gpu,
    )
    checked_mode, checked_placement = check_policy(raw)
    return replace(raw, mode=checked_mode, placement=checked_placement)


def check_takes_shares(mode: NodeMode) -> None:
    """StateError when the node gives whole GPUs: a cluster scheduler
    places GPU shares (aliyun.com/gpu-mem) only on nodes that share GPUs."""
    if mode in WHOLE_GPU_MODES:
        raise StateError(
            f"node mode {mode.value} gives whole GPUs (nvidia.com/gpu); cgpu-scheduler reserves only on nodes "
            "that share GPUs: a pod asking for aliyun.com/gpu-mem runs on a cgpu, share, core_mem or mps node"
        )


def check_policy(policy: NodePolicy) -> tuple[NodeMode, Placement]:
    """Node settings arrive from labels and a config file: check them here
    so a typo is reported as such instead of as a request that never fits."""
    try:
        mode = NodeMode(policy.mode)
    except ValueError:
        names = ", ".join(m.value for m in NodeMode)
        raise UsageError(f"unknown node mode {policy.mode!r} (ack.node.gpu.schedule): use one of {names}") from None
    try:
        placement = Placement(policy.placement)
    except ValueError:
        raise UsageError(
            f"unknown placement {policy.placement!r} (ack.node.gpu.placement): use binpack or spread"
        ) from None
    if not 1 <= policy.core_step <= 100:
        raise UsageError(
            f"node setting core_step is {policy.core_step}: set it between 1 and 100 "
            "(compute shares are multiples of it)"
        )
    if policy.max_instances_per_gpu < 1:
        raise UsageError(f"node setting max_instances_per_gpu is {policy.max_instances_per_gpu}: set it to 1 or more")
    return mode, placement


def _check_request(request: Request, gpus: Sequence[GpuCapacity], mode: NodeMode, policy: NodePolicy) -> None:
    """Everything wrong with the request itself, whatever the node holds."""
    n = request.gpu_count
    if n < 1:
        raise UsageError(f"asked for {n} GPUs: ask for at least 1 (aliyun.com/gpu-count)")
    if not gpus:
        raise UsageError(f"asked for {_gpus(n)} but this node has no GPUs: run it on a GPU node")
    if all(g.mig for g in gpus):
        raise UsageError(
            f"asked for {_gpus(n)} but every GPU of this node is in MIG mode, which cgpu does not share or give "
            f"whole: ask for a MIG device (nvidia.com/mig-<profile>, or nvidia.com/gpu under mig_strategy single), "
            "or have the node share its MIG devices (mig_share), or disable MIG on a GPU"
        )
    usable = [g for g in gpus if not g.mig]  # a GPU in MIG mode never holds a share nor goes whole
    if n > len(usable):
        raise UsageError(
            f"asked for {_gpus(n)} but this node has {len(usable)}: ask for {len(usable)} or fewer "
            "(aliyun.com/gpu-count)"
        )
    if mode is NodeMode.MPS and n > 1:
        raise UsageError(
            f"asked for {_gpus(n)} on an mps node, which runs one MPS control daemon per GPU and a process "
            "reaches one: ask for 1 GPU per container (aliyun.com/gpu-count) or run on a cgpu node"
        )
    if request.gpu_indexes:
        _check_named(request, gpus)
    if request.memory < 0:
        raise UsageError(
            f"asked for {request.memory} bytes of GPU memory: ask for a size of 0 or more (aliyun.com/gpu-mem)"
        )
    if mode not in WHOLE_GPU_MODES and request.memory == 0:
        raise UsageError(
            f"node mode {mode.value} shares GPUs by memory: ask for a memory size per GPU "
            "(aliyun.com/gpu-mem, e.g. 4 GiB) or run on a default node for whole GPUs"
        )
    if request.core_percent != 0:
        if mode in WHOLE_GPU_MODES:
            raise UsageError(
                f"node mode {mode.value} gives whole GPUs and does not divide compute; "
                "ask without a core percentage or run on a core_mem node"
            )
        if mode not in COMPUTE_SHARE_MODES:
            raise UsageError(
                f"node mode {mode.value} does not enforce compute shares; "
                "ask without a core percentage or run on a core_mem or mps node"
            )
        step = policy.core_step
        if not step <= request.core_percent <= 100 or request.core_percent % step:
            raise UsageError(
                f"asked for {request.core_percent}% compute: ask for 0 (no share) or a multiple of {step} "
                f"from {step} to 100 (aliyun.com/gpu-core.percentage)"
            )
    if request.weight < 1:
        raise UsageError(f"asked for weight {request.weight}: use 1 or more (ALIYUN_COM_GPU_SCHD_WEIGHT)")
    if request.priority < 0:
        raise UsageError(f"asked for priority {request.priority}: use 0 or more (ALIYUN_COM_GPU_HIGH_PRIO)")
    if mode not in WHOLE_GPU_MODES:
        # A size no GPU here could ever hold is a wrong request, not a busy
        # node: waiting or releasing instances would never help.
        big_enough = sum(1 for g in usable if g.memory >= request.memory)
        if big_enough < n:
            mem = format_memory(request.memory)
            if big_enough == 0:
                largest = format_memory(max(g.memory for g in usable))
                raise UsageError(
                    f"asked for {mem} per GPU but the largest GPU on this node has {largest}: "
                    f"ask for {largest} or less (aliyun.com/gpu-mem)"
                )
            raise UsageError(
                f"asked for {n} GPUs with {mem} each but only {big_enough} "
                f"{_has(big_enough)} that much memory: ask for fewer GPUs or less memory"
            )


def _check_named(request: Request, gpus: Sequence[GpuCapacity]) -> None:
    """GPUs a cluster scheduler chose: each once, as many as asked, all
    here, each large enough."""
    named = list(request.gpu_indexes)
    n = request.gpu_count
    if len(set(named)) != len(named) or len(named) != n:
        raise UsageError(f"asked for {_gpus(n)} on {_gpu_list(named)}: name each of the {_gpus(n)} once")
    by_index = {g.index: g for g in gpus}
    mig = [i for i in named if i in by_index and by_index[i].mig]
    if mig:
        raise UsageError(
            f"asked for {_gpu_list(mig)}, which {_is(len(mig))} in MIG mode: cgpu does not share a GPU in MIG "
            "mode or give it whole (its memory belongs to its MIG devices); the scheduler must choose another GPU"
        )
    absent = [i for i in named if i not in by_index]
    if absent:
        raise UsageError(
            f"asked for {_gpu_list(absent)}, which this node does not have (it has {_gpu_list(sorted(by_index))}): "
            "the scheduler's view of this node is out of date"
        )
    small = [by_index[i] for i in named if by_index[i].memory < request.memory]
    if small:
        raise UsageError(
            f"asked for {format_memory(request.memory)} on GPU {small[0].index}, which has "
            f"{format_memory(small[0].memory)}: ask for less memory (aliyun.com/gpu-mem)"
        )


def _order(usage: Iterable[GpuUsage], placement: Placement) -> list[GpuUsage]:
    """GPUs in the order placement prefers them.

    binpack: GPUs that already hold instances first, then least free memory,
    then lowest index. With identical GPUs this is plain "least free first";
    the first key keeps the promise "fill one GPU before the next" on mixed
    GPUs too, where a small empty GPU can have less free memory than a large
    busy one.
    spread: most free memory first, then lowest index."""
    if placement == Placement.BINPACK:
        return sorted(usage, key=lambda u: (u.instances == 0, _free(u), u.gpu.index))
    return sorted(usage, key=lambda u: (-_free(u), u.gpu.index))


def _free(u: GpuUsage) -> int:
    return u.gpu.memory - u.allocated


def _by_links(fitting: list[GpuUsage], n: int, links: Links, placement: Placement) -> list[GpuUsage]:
    """The best-joined n of `fitting`; among equally joined sets, placement's
    choice (on a node whose GPUs are all joined alike, always)."""
    ordered = _order(fitting, placement)
    by_index = {u.gpu.index: u for u in ordered}
    chosen = topology.best_set(links, list(by_index), n, prefer=list(by_index))
    return [u for u in ordered if u.gpu.index in chosen]


def _whole_gpus(
    request: Request, usage: tuple[GpuUsage, ...], placement: Placement, mode: NodeMode, links: Links | None = None
) -> list[GpuUsage]:
    """`default` and `topology` modes: whole GPUs, each with no active instance at all."""
    n = request.gpu_count
    idle = [u for u in usage if u.instances == 0]
    if len(idle) >= n:
        if links is not None and (mode is NodeMode.TOPOLOGY or n > 1):
            return _by_links(idle, n, links, placement)
        return _order(idle, placement)[:n]
    total = len(usage)
    how = f"node mode {mode.value} gives each container whole GPUs"
    if n == 1:
        if total == 1:
            raise AdmissionError(
                f"GPU {usage[0].gpu.index} is in use and {how}; release its instance or run on a node that "
                "shares GPUs (cgpu, core_mem)"
            )
        raise AdmissionError(
            f"{_all(total)} GPUs are in use and {how}; release an instance or run on a node that "
            "shares GPUs (cgpu, core_mem)"
        )
    free_part = f"none of {total} is free" if not idle else f"only {len(idle)} of {total} {_is(len(idle))} free"
    raise AdmissionError(f"asked for {n} whole GPUs but {free_part} ({how}); release an instance or ask for fewer GPUs")


@dataclass(frozen=True)
class _Check:
    """One GPU measured against the request, constraint by constraint."""

    usage: GpuUsage
    memory_ok: bool
    room_ok: bool  # below max_instances_per_gpu
    core_ok: bool

    @property
    def fits(self) -> bool:
        return self.memory_ok and self.room_ok and self.core_ok

    @property
    def misses(self) -> int:
        return (not self.memory_ok) + (not self.room_ok) + (not self.core_ok)


def _shared_gpus(
    request: Request,
    usage: tuple[GpuUsage, ...],
    placement: Placement,
    policy: NodePolicy,
    links: Links | None = None,
) -> list[GpuUsage]:
    """cgpu, core_mem, share, mps: a GPU fits when it has the memory free,
    room for one more instance and the compute share left. `share` and `mps`
    book memory exactly like `cgpu`: what each mode enforces is decided where
    the instance is set up, not here."""
    memory, limit, core_left = request.memory, policy.max_instances_per_gpu, _FULL_CORE - request.core_percent
    # Plain tuples first, _Check only for the reason: the cluster scheduler
    # runs this for every node and pod shape.
    measured = [
        (u, u.gpu.memory - u.allocated >= memory, u.instances < limit, u.core_percent <= core_left) for u in usage
    ]
    fitting = [u for u, memory_ok, room_ok, core_ok in measured if memory_ok and room_ok and core_ok]
    if len(fitting) >= request.gpu_count:
        if links is not None and request.gpu_count > 1:
            return _by_links(fitting, request.gpu_count, links, placement)
        return _order(fitting, placement)[: request.gpu_count]
    checks = [_Check(*m) for m in measured]
    raise AdmissionError(_shortfall(request, checks, policy))


def _shortfall(request: Request, checks: list[_Check], policy: NodePolicy) -> str:
    """Why fewer than gpu_count GPUs fit. When one constraint alone rules
    out too many GPUs, name it and the GPU that comes closest to it; when
    only their combination does, name the closest GPU and all it lacks."""
    n = request.gpu_count
    mem = format_memory(request.memory)
    limit = policy.max_instances_per_gpu

    def at_limit(count: int) -> str:
        # The limit may have been lowered below what GPUs already hold.
        if count > limit:
            return f"more than this node now allows (max_instances_per_gpu={limit})"
        return "the most this node allows (max_instances_per_gpu)"

    def count_has(k: int, what: str) -> str:
        return f"but none has {what}" if k == 0 else f"but only {k} {_has(k)} {what}"

    def most_or_next(k: int) -> str:
        return "most" if k == 0 else "the next most"

    memory_ok = [c for c in checks if c.memory_ok]
    if len(memory_ok) < n:
        best = min((c.usage for c in checks if not c.memory_ok), key=lambda u: (-_free(u), u.gpu.index))
        where = f"{format_memory(max(_free(best), 0))} on GPU {best.gpu.index} (of {format_memory(best.gpu.memory)})"
        if n == 1:
            return f"no GPU has {mem} free: most free is {where}; release an instance or ask for less memory"
        return (
            f"asked for {n} GPUs with {mem} free each {count_has(len(memory_ok), 'that much')}: "
            f"{most_or_next(len(memory_ok))} free is {where}; release an instance, ask for fewer GPUs "
            "or ask for less memory"
        )

    room_ok = [c for c in checks if c.room_ok]
    if len(room_ok) < n:
        full = [c.usage for c in checks if not c.room_ok]
        most = max(u.instances for u in full)
        # "20 instances" in the usual case; "20 or more" once the limit was
        # lowered below what some GPUs already hold.
        held = _instances(limit) if most == limit else f"{_instances(limit)} or more"
        allows = "the most this node allows (max_instances_per_gpu)"
        if len(checks) == 1:
            only = full[0]
            return (
                f"GPU {only.gpu.index} already holds {_instances(only.instances)}, {at_limit(only.instances)}; "
                "release one or raise the limit"
            )
        if not room_ok:
            return f"{_all(len(checks))} GPUs already hold {held}, {allows}; release one or raise the limit"
        verb = "holds" if len(full) == 1 else "hold"
        return (
            f"asked for {n} GPUs {count_has(len(room_ok), 'room for another instance')}: "
            f"{_gpu_list([u.gpu.index for u in full])} already {verb} {held}, {allows}; "
            "release one, raise the limit or ask for fewer GPUs"
        )

    core_ok = [c for c in checks if c.core_ok]
    want = request.core_percent
    if len(core_ok) < n:
        best = min((c.usage for c in checks if not c.core_ok), key=lambda u: (u.core_percent, u.gpu.index))
        where = f"{max(_FULL_CORE - best.core_percent, 0)}% on GPU {best.gpu.index}"
        if n == 1:
            return (
                f"no GPU has {want}% compute left: most left is {where}; "
                "release an instance or ask for a smaller core percentage"
            )
        return (
            f"asked for {n} GPUs with {want}% compute each {count_has(len(core_ok), 'that much left')}: "
            f"{most_or_next(len(core_ok))} left is {where}; release an instance, ask for fewer GPUs "
            "or ask for a smaller core percentage"
        )

    # Each constraint alone leaves enough GPUs, only together they do not.
    fitting = sum(1 for c in checks if c.fits)
    closest = min((c for c in checks if not c.fits), key=lambda c: (c.misses, -_free(c.usage), c.usage.gpu.index))
    u = closest.usage
    lacks = []
    if not closest.memory_ok:
        lacks.append(f"has only {format_memory(max(_free(u), 0))} free (of {format_memory(u.gpu.memory)})")
    if not closest.room_ok:
        lacks.append(f"already holds {_instances(u.instances)}, {at_limit(u.instances)}")
    if not closest.core_ok:
        lacks.append(f"has only {max(_FULL_CORE - u.core_percent, 0)}% compute left")
    whole = f"{mem} free, room for another instance" + (f" and {want}% compute" if want else "")
    reason = f"GPU {u.gpu.index}, {' and '.join(lacks)}"
    if n == 1:
        return f"no GPU has all of {whole}: the closest, {reason}; release an instance or ask for less"
    found = "none has all of it" if fitting == 0 else f"only {fitting} {_has(fitting)} all of it"
    other = "the closest" if fitting == 0 else "the closest other"
    return (
        f"asked for {n} GPUs each with {whole} but {found}: {other}, {reason}; "
        "release an instance or ask for fewer GPUs or less"
    )


# --------------------------------------------------------------------------
# Reservations (a cluster scheduler holding capacity for a pod it binds here)


def check_reservation(
    shares: Sequence[Share],
    gpus: Sequence[GpuCapacity],
    active: Sequence[Instance],
    reserved_others: Sequence[Reservation],
    policy: NodePolicy,
) -> None:
    """None when `shares` can be held now on top of the active instances and
    the other live reservations; else UsageError for a wrong request,
    StateError when the node gives whole GPUs, AdmissionError when a share
    does not fit now. Same inputs, same answer."""
    mode, _ = check_policy(policy)
    if not shares:
        raise UsageError("a reservation needs at least one GPU share: name a GPU, its memory and compute")
    indexes = [s.gpu_index for s in shares]
    twice = sorted({i for i in indexes if indexes.count(i) > 1})
    if twice:
        raise UsageError(f"the reservation names {_gpu_list(twice)} more than once: give one share per GPU")
    by_index = {g.index: g for g in gpus}
    absent = sorted(i for i in indexes if i not in by_index)
    if absent:
        have = f"it has {_gpu_list(sorted(by_index))}" if by_index else "it has no GPUs"
        raise UsageError(
            f"the reservation names {_gpu_list(absent)}, which this node does not have ({have}): "
            "the scheduler's view of this node is out of date"
        )
    for share in sorted(shares, key=lambda s: s.gpu_index):
        gpu = by_index[share.gpu_index]
        if share.memory <= 0:
            raise UsageError(
                f"the reservation asks for {share.memory} bytes on GPU {gpu.index}: "
                "ask for a memory size above 0 (aliyun.com/gpu-mem)"
            )
        if share.memory > gpu.memory:
            raise UsageError(
                f"the reservation asks for {format_memory(share.memory)} on GPU {gpu.index}, which has "
                f"{format_memory(gpu.memory)}: ask for {format_memory(gpu.memory)} or less (aliyun.com/gpu-mem)"
            )
        if share.instances < 0:
            raise UsageError(
                f"the reservation asks for {share.instances} instance slots on GPU {gpu.index}: use 0 or more"
            )
    check_takes_shares(mode)
    step = policy.core_step
    for share in shares:
        if share.core_percent == 0:
            continue
        if mode not in COMPUTE_SHARE_MODES:
            raise UsageError(
                f"node mode {mode.value} does not enforce compute shares; "
                "reserve without a core percentage or use a core_mem or mps node"
            )
        if not step <= share.core_percent <= 100 or share.core_percent % step:
            raise UsageError(
                f"the reservation asks for {share.core_percent}% compute on GPU {share.gpu_index}: ask for 0 "
                f"(no share) or a multiple of {step} from {step} to 100 (aliyun.com/gpu-core.percentage)"
            )
    usage = {u.gpu.index: u for u in gpu_usage(gpus, active, reserved_others)}
    limit = policy.max_instances_per_gpu
    for share in sorted(shares, key=lambda s: s.gpu_index):
        u = usage[share.gpu_index]
        free = max(_free(u), 0)
        if share.memory > free:
            raise AdmissionError(
                f"GPU {u.gpu.index} has {format_memory(free)} free (of {format_memory(u.gpu.memory)}) and the "
                f"reservation asks for {format_memory(share.memory)}; release an instance or reserve less"
            )
        if share.instances and u.instances + share.instances > limit:
            room = max(limit - u.instances, 0)
            raise AdmissionError(
                f"GPU {u.gpu.index} has room for {_instances(room)} more (max_instances_per_gpu={limit}, "
                f"{u.instances} held) and the reservation asks for {share.instances}; "
                "release one or raise the limit"
            )
        if u.core_percent + share.core_percent > _FULL_CORE:
            left = max(_FULL_CORE - u.core_percent, 0)
            raise AdmissionError(
                f"GPU {u.gpu.index} has {left}% compute left and the reservation asks for "
                f"{share.core_percent}%; release an instance or reserve a smaller core percentage"
            )


def consume(reservation: Reservation, grants: Sequence[Grant]) -> tuple[Share, ...]:
    """What is left of `reservation` once an instance with `grants` drew on
    it: each granted GPU's share loses the grant's memory, compute and one
    instance slot; a share left with no memory is dropped. Grants on GPUs
    the reservation does not hold take nothing from it."""
    taken = {g.gpu_index: g for g in grants}
    left = []
    for share in reservation.shares:
        grant = taken.get(share.gpu_index)
        if grant is None:
            left.append(share)
            continue
        memory = share.memory - grant.memory
        if memory <= 0:
            continue
        left.append(
            Share(share.gpu_index, memory, max(share.core_percent - grant.core_percent, 0), max(share.instances - 1, 0))
        )
    return tuple(left)


# --------------------------------------------------------------------------
# Node policy changes (labels, at runtime)

# What each mode does to an instance; a change between modes that do the
# same leaves every instance as it was granted.
_ENFORCEMENT = {
    NodeMode.DEFAULT: "whole GPUs",
    NodeMode.TOPOLOGY: "whole GPUs",
    NodeMode.SHARE: "memory bookkeeping only",
    NodeMode.CGPU: "memory isolation",
    NodeMode.MPS: "memory isolation, compute through MPS",
    NodeMode.CORE_MEM: "memory and compute isolation",
}


def policy_change_problem(
    current: NodePolicy, mode: NodeMode, active: Sequence[Instance], compute_running: bool, mps_running: bool = False
) -> str | None:
    """Why the node may not switch to `mode` now, None when it may. A
    placement change is always allowed: it only orders GPUs for the next
    request. A mode change is refused while an active instance was granted
    under a mode that enforces otherwise (it would keep limits the node no
    longer has, or lack ones it has), and into or out of core_mem when the
    compute scheduler would not match the mode (`compute_running`: whether
    it runs once the change is made; the service starts or stops it on a
    drained node)."""
    if mode == current.mode:
        return None
    live = [i for i in active if i.active]
    if live and _ENFORCEMENT[mode] != _ENFORCEMENT[current.mode]:
        return (
            f"mode {mode.value} ({_ENFORCEMENT[mode]}) would break the {_instances(len(live))} granted under "
            f"{current.mode.value} ({_ENFORCEMENT[current.mode]}); release them (drain the node) first"
        )
    wants_compute = mode == NodeMode.CORE_MEM
    if wants_compute != compute_running:
        started = "runs" if compute_running else "does not run"
        return (
            f"the compute scheduler {started} in this cgpud (it is started with core_mem mode only): restart cgpud "
            f"to switch to {mode.value}; it reads the node's labels at start"
        )
    if (mode is NodeMode.MPS) != mps_running:
        started = "run" if mps_running else "do not run"
        return (
            f"the MPS control daemons {started} in this cgpud (they are started with mps mode only): restart cgpud "
            f"to switch to {mode.value}; it reads the node's labels at start"
        )
    return None


# --------------------------------------------------------------------------
# Words


def _gpus(n: int) -> str:
    return "1 GPU" if n == 1 else f"{n} GPUs"


def _instances(n: int) -> str:
    return "1 instance" if n == 1 else f"{n} instances"


def _all(n: int) -> str:
    return "both" if n == 2 else f"all {n}"


def _has(n: int) -> str:
    return "has" if n == 1 else "have"


def _is(n: int) -> str:
    return "is" if n == 1 else "are"


def _gpu_list(indexes: list[int]) -> str:
    """ "GPU 0", "GPUs 0 and 2", "GPUs 0, 1 and 3"."""
    if len(indexes) == 1:
        return f"GPU {indexes[0]}"
    head = ", ".join(str(i) for i in indexes[:-1])
    return f"GPUs {head} and {indexes[-1]}"
