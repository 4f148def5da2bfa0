"""Whether a pod fits a node, on which GPUs, and how well: the extender's
filter and prioritize, pure.

The rules mirror the node's own admission (cgpud/node/placement.py), so a
node the extender picks admits the pod: default and topology nodes give whole
GPUs and take no shares; a compute share needs a core_mem node and a multiple
of its core_step; a GPU takes a container when it has the memory free, room
for one more instance and the compute left; unhealthy GPUs never. A pod's
containers are placed in order on a working copy of the node, each on
`gpu_count` GPUs picked by the node's placement: binpack takes GPUs holding
instances first, then the least free, then the lowest index; spread the most
free, then the lowest index.

This is the hot path (every node, every pod): `summarize` does the per-view
work once when a view arrives, and a summary remembers its answers per pod
shape, so a node whose view did not change answers the next pod of the same
shape with one dictionary look-up.
"""
# No `from __future__ import annotations` here: it would bind the name of
# annotations() below (mypy then sees the __future__ feature, not the function).

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cgpud.node.model import Share
from cgpud.extender.model import NodeState
from cgpud.extender.pod import GIB, PodDemand
from cgpud.kube.model import (
    ANNOTATION_ALLOCATION,
    ANNOTATION_ASSIGNED,
    ANNOTATION_ASSUME_TIME,
    ANNOTATION_GPU_INDEX,
    ANNOTATION_GPU_MEM_DEV,
    ANNOTATION_POD_MEMORY,
)

MAX_SCORE = 10  # kube-scheduler's MaxExtenderPriority
_FULL_CORE = 100
_SHARING_MODES = ("share", "cgpu", "core_mem", "mps")
_WHOLE_MODES = ("default", "topology")
_CACHE_SIZE = 64  # pod shapes remembered per view


# Named tuples, not dataclasses: one is made per node and pod shape on the
# hot path, and a tuple is built several times faster than a frozen dataclass.


class Reason(NamedTuple):
    """Why a pod does not fit a node. `resolvable`: whether removing pods
    from the node could make it fit (kube-scheduler may preempt for it);
    otherwise no eviction helps (wrong mode, too large, node down).
    `transient`: the node is unknown only for now (its cgpud not reached
    yet), which no Kubernetes event will announce when it ends."""

    text: str
    resolvable: bool = True
    transient: bool = False


class Placement(NamedTuple):
    """Where a pod's GPU containers go on one node. `containers` follow the
    demand's order: (bytes per GPU, core percent, GPU indexes)."""

    node: str
    containers: tuple[tuple[int, int, tuple[int, ...]], ...]
    fullness: float  # mean share of memory taken on the chosen GPUs once the pod is there
    spread: bool  # the node's placement is spread
    score: int = 0  # 0..MAX_SCORE, see score()

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted({i for _, _, idx in self.containers for i in idx}))


Row = tuple[int, int, int, int, int, int]  # index, total, free, core, instances, max instances


@dataclass
class NodeSummary:
    """A node's view reduced to what fit needs, built once per view."""

    state: NodeState
    problem: Reason | None  # refuses every GPU-share pod (mode), else None
    core_mem: bool
    core_step: int
    spread: bool
    gpus: tuple[Row, ...]  # the healthy GPUs, in index order
    order: tuple[Row, ...]  # the healthy GPUs with room and compute left, in the placement's order
    unhealthy: tuple[tuple[int, str], ...]
    largest: int  # the largest GPU's memory, healthy or not
    most_free: int  # the most free memory of a GPU in `order`
    name_json: str = ""  # the node's name as a JSON string, for answers built as text
    cache: dict[Any, Placement | Reason] = field(default_factory=dict)  # by PodDemand.fit_key
    # Per pod shape, fit's answer with the node's part of a filter or
    # prioritize answer as JSON text: `"name":"reason"` (FailedNodes) or
    # `{"Host":"name","Score":n}`.
    rendered: dict[Any, tuple[Placement | Reason, str]] = field(default_factory=dict)


def summarize(state: NodeState, name: str | None = None) -> NodeSummary:
    problem = None
    if state.mode in _WHOLE_MODES:
        problem = Reason(f"node mode {state.mode} gives whole GPUs and takes no GPU shares; a pod asking for "
                         "aliyun.com/gpu-mem runs on a cgpu, share, core_mem or mps node", resolvable=False)
    elif state.mode not in _SHARING_MODES:
        problem = Reason(f"node reports an unknown mode {state.mode!r}", resolvable=False)
    gpus = tuple((g.index, g.memory_total, g.memory_total - g.memory_allocated, g.core_allocated, g.instances,
                  g.max_instances) for g in state.gpus if g.healthy)
    spread = state.placement == "spread"
    order = _sorted([g for g in gpus if g[4] < g[5] and g[3] < _FULL_CORE], spread)
    return NodeSummary(
        state=state, problem=problem, core_mem=state.mode == "core_mem", core_step=max(state.core_step, 1),
        spread=spread, gpus=gpus, order=order,
        unhealthy=tuple((g.index, g.health_reason) for g in state.gpus if not g.healthy),
        largest=max((g.memory_total for g in state.gpus), default=0),
        most_free=max((g[2] for g in order), default=0), name_json=json.dumps(state.name if name is None else name))


def _sorted(rows: list[Row], spread: bool) -> tuple[Row, ...]:
    """binpack: GPUs holding instances first, then least free, then index;
    spread: most free, then index (the node's placement._order)."""
    if spread:
        return tuple(sorted(rows, key=lambda g: (-g[2], g[0])))
    return tuple(sorted(rows, key=lambda g: (g[4] == 0, g[2], g[0])))


def fit(demand: PodDemand, node: NodeSummary | NodeState) -> Placement | Reason:
    """Where the pod's GPU containers go on the node, or why they do not fit.
    Same inputs, same answer."""
    summary = node if isinstance(node, NodeSummary) else summarize(node)
    shape = demand.fit_key
    cached = summary.cache.get(shape)
    if cached is not None:
        return cached
    answer = _fit(demand, summary)
    if len(summary.cache) >= _CACHE_SIZE:
        summary.cache.clear()
        summary.rendered.clear()
    summary.cache[shape] = answer
    return answer


def rendered(demand: PodDemand, summary: NodeSummary) -> tuple[Placement | Reason, str]:
    """fit's answer and the node's part of the extender's answer as JSON
    text (see NodeSummary.rendered), both remembered per pod shape."""
    shape = demand.fit_key
    hit = summary.rendered.get(shape)
    if hit is not None:
        return hit
    answer = fit(demand, summary)
    if isinstance(answer, Reason):
        text = f"{summary.name_json}:{json.dumps(answer.text)}"
    else:
        text = f'{{"Host":{summary.name_json},"Score":{answer.score}}}'
    summary.rendered[shape] = hit = (answer, text)
    return hit


def _fit(demand: PodDemand, s: NodeSummary) -> Placement | Reason:
    if s.problem is not None:
        return s.problem
    # One comparison passes most pods on most nodes; the checks below only
    # run to find the reason.
    quick = demand.most_per_gpu <= s.most_free and demand.most_count <= len(s.order)
    if demand.cores and (not s.core_mem or any(k % s.core_step for k in demand.cores)):
        quick = False
    if not quick:
        reason = _refusal(demand, s)
        if reason is not None:
            return reason
    if len(demand.containers) == 1:
        memory, core, count = demand.shape[0]
        if count == 1:  # the common pod, without the general path's lists
            for g in s.order:
                if g[2] >= memory and g[3] + core <= _FULL_CORE:
                    return _placement(s, ((memory, core, (g[0],)),), (g[1] - g[2] + memory) / g[1])
            return _shortfall(demand.labels[0], 1, memory, core, s.gpus, s)
        chosen = _choose(s.order, memory, core, count)
        if chosen is None:
            return _shortfall(demand.labels[0], count, memory, core, s.gpus, s)
        taken = sum((g[1] - g[2] + memory) / g[1] for g in chosen) / len(chosen)
        return _placement(s, ((memory, core, tuple(sorted(g[0] for g in chosen))),), taken)
    # Several containers: each on a working copy that holds the ones before it.
    work = {g[0]: g for g in s.gpus}
    placed: list[tuple[int, int, tuple[int, ...]]] = []
    for (memory, core, count), label in zip(demand.shape, demand.labels):
        rows = [g for g in work.values() if g[4] < g[5] and g[3] < _FULL_CORE]
        chosen = _choose(_sorted(rows, s.spread), memory, core, count)
        if chosen is None:
            return _shortfall(label, count, memory, core, tuple(work.values()), s, others=len(placed))
        for g in chosen:
            work[g[0]] = (g[0], g[1], g[2] - memory, g[3] + core, g[4] + 1, g[5])
        placed.append((memory, core, tuple(sorted(g[0] for g in chosen))))
    used = {i for _, _, idx in placed for i in idx}
    taken = sum((work[i][1] - work[i][2]) / work[i][1] for i in used) / len(used)
    return _placement(s, tuple(placed), taken)


def _placement(s: NodeSummary, containers: tuple[tuple[int, int, tuple[int, ...]], ...],
               fullness: float) -> Placement:
    full = min(max(fullness, 0.0), 1.0)
    points = round(MAX_SCORE * ((1.0 - full) if s.spread else full))
    return Placement(s.state.name, containers, fullness, s.spread, points)


def _refusal(demand: PodDemand, s: NodeSummary) -> Reason | None:
    """Why a container can never fit here, or does not fit now even alone."""
    n_all = len(s.state.gpus)
    for (per_gpu, core, count), label in zip(demand.shape, demand.labels):
        if core:
            if not s.core_mem:
                return Reason(f"{label}asks for {core}% compute but node mode {s.state.mode} does not "
                              "divide compute; compute shares run on core_mem nodes", resolvable=False)
            if core % s.core_step:
                return Reason(f"{label}asks for {core}% compute but this node gives compute in steps "
                              f"of {s.core_step}%; ask for a multiple of {s.core_step}", resolvable=False)
        if count > n_all:
            return Reason(f"{label}asks for {count} GPUs but this node has {n_all}", resolvable=False)
        if per_gpu > s.largest:
            return Reason(f"{label}asks for {per_gpu // GIB} GiB per GPU but this node's largest GPU has "
                          f"{_gib(s.largest)}", resolvable=False)
        if count > len(s.gpus):
            return Reason(f"{label}asks for {count} GPUs but only {len(s.gpus)} of {n_all} are healthy"
                          f"{_sick(s)}", resolvable=False)
        if per_gpu > s.most_free or count > len(s.order):
            return _shortfall(label, count, per_gpu, core, s.gpus, s)
    return None


def _choose(order: tuple[Row, ...], memory: int, core: int, count: int) -> list[Row] | None:
    """The first `count` GPUs in placement order that take the container
    (`order` holds only GPUs with room for an instance)."""
    chosen = []
    for g in order:
        if g[2] >= memory and g[3] + core <= _FULL_CORE:
            chosen.append(g)
            if len(chosen) == count:
                return chosen
    return None


def _shortfall(label: str, count: int, memory: int, core: int, gpus: tuple[tuple[int, ...], ...],
               s: NodeSummary, others: int = 0) -> Reason:
    """Why fewer than `count` healthy GPUs take the container, naming the
    GPU that comes closest."""
    want = f"{memory // GIB} GiB free, room for an instance" + (f" and {core}% compute" if core else "")
    fitting = sum(1 for g in gpus if g[2] >= memory and g[4] < g[5] and g[3] + core <= _FULL_CORE)
    after = f" beside the pod's {others} container(s) placed before it" if others else ""
    if not gpus:
        return Reason(f"{label}no healthy GPU on this node{_sick(s)}", resolvable=False)
    best = max(gpus, key=lambda g: ((g[2] >= memory) + (g[4] < g[5]) + (g[3] + core <= _FULL_CORE), g[2], -g[3],
                                    -g[0]))
    lacks = []
    if best[2] < memory:
        lacks.append(f"{_gib(max(best[2], 0))} free of {_gib(best[1])}")
    if best[4] >= best[5]:
        lacks.append(f"{best[4]} instances, its most")
    if best[3] + core > _FULL_CORE:
        lacks.append(f"{max(_FULL_CORE - best[3], 0)}% compute left")
    closest = f"closest is GPU {best[0]} with {', '.join(lacks)}" if lacks else f"GPU {best[0]} has it"
    if count == 1:
        return Reason(f"{label}no GPU has {want}{after}: {closest}")
    return Reason(f"{label}asks for {count} GPUs with {want} each but {fitting} have it{after}: "
                  f"{closest if lacks else 'the others lack it'}")


def _sick(s: NodeSummary) -> str:
    if not s.unhealthy:
        return ""
    index, why = s.unhealthy[0]
    return f" (GPU {index} is unhealthy: {why or 'no reason given'})"


def _gib(n: int) -> str:
    gib = n / GIB
    return f"{gib:.0f} GiB" if gib == int(gib) else f"{gib:.1f} GiB"


def score(placement: Placement) -> int:
    """0..MAX_SCORE: binpack favours the node whose chosen GPUs end fullest,
    spread the one whose chosen GPUs end emptiest."""
    return placement.score


def shares(placement: Placement) -> tuple[Share, ...]:
    """Per GPU what Reserve holds: the memory and compute of every container
    placed there, one instance slot each."""
    per: dict[int, list[int]] = {}
    for memory, core, gpus in placement.containers:
        for i in gpus:
            slot = per.setdefault(i, [0, 0, 0])
            slot[0] += memory
            slot[1] += core
            slot[2] += 1
    return tuple(Share(i, m, c, n) for i, (m, c, n) in sorted(per.items()))


def annotations(demand: PodDemand, placement: Placement, state: NodeState, now_ns: int) -> dict[str, str]:
    """The gpushare annotations the device plugin reads at Allocate
    (cgpud/kube/assignment.py) to find the pod and the GPUs chosen here."""
    gpus = placement.gpus
    totals = {g.index: g.memory_total for g in state.gpus}
    out = {
        ANNOTATION_GPU_INDEX: ",".join(str(i) for i in gpus),
        ANNOTATION_POD_MEMORY: str(demand.memory_gib),
        ANNOTATION_GPU_MEM_DEV: str(totals.get(gpus[0], 0) // GIB),
        ANNOTATION_ASSUME_TIME: str(now_ns),
        ANNOTATION_ASSIGNED: "false",
    }
    regular = [(c, p) for c, p in zip(demand.containers, placement.containers) if not c.init]
    if len(demand.containers) > 1 or any(len(p[2]) > 1 for _, p in regular):
        allocation: dict[str, dict[str, int]] = {}
        for c, (memory, _, idx) in regular:
            allocation[str(c.index)] = {str(i): memory // GIB for i in idx}
        out[ANNOTATION_ALLOCATION] = json.dumps(allocation, sort_keys=True, separators=(",", ":"))
    return out


def failed_maps(reasons: Mapping[str, Reason]) -> tuple[dict[str, str], dict[str, str]]:
    """(FailedNodes, FailedAndUnresolvableNodes) of a filter answer."""
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for name, r in reasons.items():
        (failed if r.resolvable else unresolvable)[name] = r.text
    return failed, unresolvable


def demand_json(demand: PodDemand) -> dict[str, Any]:
    """A demand as plain data, for logs and /inspect."""
    return {"pod": demand.key, "uid": demand.uid,
            "containers": [{"name": c.name, "memory_gib": c.memory_gib, "core_percent": c.core_percent,
                            "gpu_count": c.gpu_count} for c in demand.containers]}
