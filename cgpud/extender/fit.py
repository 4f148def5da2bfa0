"""Whether a pod fits a node, on which GPUs, and how well: the extender's
filter and prioritize, pure.

The node judges: each container is admitted by the node's own admission
(cgpud/node/placement.py, admit_usage) on what the node's Capacity view
shows held of its healthy GPUs, in the pod's order, each on the usage the
ones before it leave, as the node admits them one Allocate after the
other. What is the extender's own: a node that gives whole GPUs takes no
share from it, unhealthy GPUs are left out, the score, and the words that
say which container of the pod did not fit and why the GPUs it counted are
fewer than the node has.

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

from cgpud.errors import AdmissionError, StateError, UsageError
from cgpud.node import placement as admission
from cgpud.node.model import GpuCapacity, GpuUsage, NodeMode, NodePolicy, Owner, OwnerKind, Request, Share
from cgpud.node.model import Placement as NodePlacement
from cgpud.node.topology import Links, set_score
from cgpud.extender.model import NodeState
from cgpud.extender.pod import GIB, PodDemand
from cgpud.kube.model import Resource
from cgpud.kube.model import ANNOTATION_ALLOCATION, ANNOTATION_ASSIGNED, ANNOTATION_ASSUME_TIME, ANNOTATION_GPU_INDEX
from cgpud.kube.model import ANNOTATION_GPU_MEM_DEV, ANNOTATION_POD_MEMORY

MAX_SCORE = 10  # kube-scheduler's MaxExtenderPriority
_CACHE_SIZE = 64  # pod shapes remembered per view
_OWNER = Owner(OwnerKind.POD, "")  # admission reads no owner; a request needs one


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


class Rendered(NamedTuple):
    """fit's answer for one node and pod shape, with the node's pieces of
    the extender's answers as JSON text, made once per view and shape (off
    the request path when the shape is a recent one): a request joins them.
    A piece is "" where the node has none in that list."""

    answer: Placement | Reason
    text: str  # `"name":"reason"` when refused, else `{"Host":"name","Score":n}`
    passed: str  # filter's NodeNames entry: `"name"`
    failed: str  # filter's FailedNodes entry (a reason eviction may fix)
    never: str  # filter's FailedAndUnresolvableNodes entry
    scored: str  # prioritize's entry (score 0 when refused)


def render(answer: Placement | Reason, name_json: str) -> Rendered:
    if isinstance(answer, Reason):
        text = f"{name_json}:{json.dumps(answer.text)}"
        zero = f'{{"Host":{name_json},"Score":0}}'
        if answer.resolvable:
            return Rendered(answer, text, "", text, "", zero)
        return Rendered(answer, text, "", "", text, zero)
    text = f'{{"Host":{name_json},"Score":{answer.score}}}'
    return Rendered(answer, text, name_json, "", "", text)


@dataclass
class NodeSummary:
    """A node's view in the node's own vocabulary, built once per view."""

    state: NodeState
    problem: Reason | None  # refuses every GPU-share pod (mode, settings, no healthy GPU), else None
    policy: NodePolicy | None  # None when `problem` is about the settings
    usage: tuple[GpuUsage, ...]  # what the view shows held of each healthy GPU, in index order
    sick: str  # "" when every GPU is healthy, else how many are and why the first is not
    name_json: str = ""  # the node's name as a JSON string, for answers built as text
    cache: dict[Any, Placement | Reason] = field(default_factory=dict)  # by PodDemand.fit_key
    # Per pod shape, fit's answer with the node's part of a filter or
    # prioritize answer as JSON text: `"name":"reason"` (FailedNodes) or
    # `{"Host":"name","Score":n}`.
    rendered: dict[Any, Rendered] = field(default_factory=dict)
    # How the GPUs are joined (the view's links); None from a cgpud too old
    # to say: multi-GPU choices then go by placement alone.
    links: Links | None = None

    @property
    def spread(self) -> bool:
        return self.policy is not None and self.policy.placement == NodePlacement.SPREAD


def node_usage(state: NodeState) -> tuple[GpuUsage, ...]:
    """What the view shows held of each healthy GPU (instances, the node's
    reservations and the extender's holds together), as admission counts it."""
    return tuple(
        GpuUsage(GpuCapacity(g.index, g.uuid, g.memory_total), g.memory_allocated, g.core_allocated, g.instances)
        for g in state.gpus
        if g.healthy
    )


def summarize(state: NodeState, name: str | None = None) -> NodeSummary:
    usage = node_usage(state)
    unhealthy = [g for g in state.gpus if not g.healthy]
    sick = why = ""
    if unhealthy:
        why = f"GPU {unhealthy[0].index} is unhealthy: {unhealthy[0].health_reason or 'no reason given'}"
        sick = f"only {len(usage)} of {len(state.gpus)} are healthy ({why})"
    problem: Reason | None = None
    policy: NodePolicy | None = None
    try:
        # The view carries the node's settings as text and each GPU's
        # instance limit (the node's one max_instances_per_gpu).
        policy = admission.parse_policy(
            state.mode, state.placement, state.core_step, max((g.max_instances for g in state.gpus), default=1)
        )
        admission.check_takes_shares(policy.mode)
    except (UsageError, StateError) as e:
        problem = Reason(str(e), resolvable=False)
    if problem is None and not usage and state.gpus:
        problem = Reason(f"no healthy GPU on this node ({why})", resolvable=False)
    return NodeSummary(
        state=state,
        problem=problem,
        policy=policy,
        usage=usage,
        sick=sick,
        name_json=json.dumps(state.name if name is None else name),
        links=state.topology() or None,
    )


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


def rendered(demand: PodDemand, summary: NodeSummary) -> Rendered:
    """fit's answer and the node's parts of the extender's answers as JSON
    text (see Rendered), remembered per pod shape."""
    shape = demand.fit_key
    hit = summary.rendered.get(shape)
    if hit is not None:
        return hit
    summary.rendered[shape] = hit = render(fit(demand, summary), summary.name_json)
    return hit


def _fit(demand: PodDemand, s: NodeSummary) -> Placement | Reason:
    if demand.whole:
        return _fit_whole(demand, s)
    if s.problem is not None:
        return s.problem
    assert s.policy is not None  # no problem: the settings were read
    usage = s.usage
    placed: list[tuple[int, int, tuple[int, ...]]] = []
    added: dict[int, int] = {}  # bytes the pod takes per GPU
    last = len(demand.shape) - 1
    for k, ((memory, core, count), label) in enumerate(zip(demand.shape, demand.labels)):
        try:
            grants = admission.admit_usage(Request(_OWNER, memory, count, core), usage, s.policy, s.links)
        except (UsageError, AdmissionError) as e:
            return _refused(e, label, k, s)
        placed.append((memory, core, tuple(g.gpu_index for g in grants)))
        for g in grants:
            added[g.gpu_index] = added.get(g.gpu_index, 0) + g.memory
        if k < last:  # the next container is admitted beside this one, as the node admits it
            usage = admission.with_shares(usage, [Share(g.gpu_index, g.memory, g.core_percent) for g in grants])
    taken = [(u.allocated + added[u.gpu.index]) / u.gpu.memory for u in s.usage if u.gpu.index in added]
    fullness = sum(taken) / len(taken)
    full = min(max(fullness, 0.0), 1.0)
    spread = s.spread
    points = round(MAX_SCORE * ((1.0 - full) if spread else full))
    return Placement(s.state.name, tuple(placed), fullness, spread, points)


def _fit_whole(demand: PodDemand, s: NodeSummary) -> Placement | Reason:
    """Whole GPUs (aliyun.com/gpu) on a topology node: the node's admission
    picks the best-joined set of the GPUs no pod holds (the view counts
    those the kubelet gave whole); the score is how well joined the sets
    are (10: every pair as well as the node's best pair), or, for single
    GPUs, binpack or spread by GPUs in use."""
    mode = s.state.mode
    if mode != NodeMode.TOPOLOGY.value:
        return Reason(
            f"node mode {mode} does not give {Resource.GPU_TOPOLOGY.value}: whole GPUs chosen by topology come "
            "from topology nodes (ack.node.gpu.schedule=topology)",
            resolvable=False,
        )
    if s.policy is None:
        return s.problem or Reason("the node's settings cannot be read", resolvable=False)
    if not s.usage:
        return Reason(f"no healthy GPU on this node ({s.sick})", resolvable=False)
    usage = s.usage
    placed: list[tuple[int, int, tuple[int, ...]]] = []
    joined: list[float] = []
    best_pair = max((link.score for link in (s.links or {}).values()), default=0)
    for k, (c, label) in enumerate(zip(demand.containers, demand.labels)):
        try:
            grants = admission.admit_usage(Request(_OWNER, 0, c.gpu_count), usage, s.policy, s.links)
        except (UsageError, AdmissionError) as e:
            return _refused(e, label, k, s)
        gpus = tuple(g.gpu_index for g in grants)
        placed.append((0, 0, gpus))
        usage = admission.with_shares(usage, [Share(g.gpu_index, 0, 0) for g in grants])
        if len(gpus) > 1 and s.links and best_pair:
            pairs = len(gpus) * (len(gpus) - 1) // 2
            joined.append(set_score(s.links, gpus) / (pairs * best_pair))
    in_use = sum(1 for u in usage if u.instances) / len(usage)
    if joined:
        points = round(MAX_SCORE * sum(joined) / len(joined))
    else:
        points = round(MAX_SCORE * ((1.0 - in_use) if s.spread else in_use))
    return Placement(s.state.name, tuple(placed), in_use, s.spread, points)


def _refused(error: Exception, label: str, others: int, s: NodeSummary) -> Reason:
    """The node's reason, with which container it is about, what the pod
    already took and which GPUs were left out as unhealthy. A wrong request
    (UsageError) is one no eviction can fix."""
    text = f"{label}{error}"
    if others:
        text += f" (beside the pod's {others} container(s) placed before it)"
    if s.sick:
        text = f"{s.sick}; of those: {text}"
    return Reason(text, resolvable=isinstance(error, AdmissionError))


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
    return {
        "pod": demand.key,
        "uid": demand.uid,
        "containers": [
            {"name": c.name, "memory_gib": c.memory_gib, "core_percent": c.core_percent, "gpu_count": c.gpu_count}
            for c in demand.containers
        ],
    }
