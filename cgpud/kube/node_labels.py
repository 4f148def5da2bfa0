"""The node describes itself: cgpud reads its Node's `ack.node.gpu.schedule`
and `ack.node.gpu.placement` labels and writes the card-model labels
(`aliyun.accelerator/nvidia_name`, `nvidia_mem`, `nvidia_count`) and, with
the Capacity API on, the `cgpu.io/capacity-address` annotation.

A label absent means the config file's (or flag's) value. A label change
takes effect without a restart, by the rules of
cgpud.node.placement.policy_change_problem: placement always; a mode only
while no active instance would be enforced differently under it (and not
into or out of core_mem, whose compute scheduler cgpud starts only at
start). A refused change is logged once and applied as soon as it is
allowed (the node drained).

When the API server cannot be reached (an outage, or no credentials at
all) cgpud keeps the policy it has (its config's, at start), says so once,
tries again with a doubling wait, and catches up when it answers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from cgpud.node.model import MAX_SCHEDULED, NodeMode, NodePolicy, Placement
from cgpud.errors import CgpuError
from cgpud.kube.apiserver import ApiServerError, ApiServerUnavailable, NodeInfo
from cgpud.kube.model import LABEL_MODE, LABEL_PLACEMENT

DEFAULT_INTERVAL = 10.0  # seconds between looks at the Node's labels
MAX_BACKOFF = 300.0  # the longest wait between tries while the API server is away


class NodeSource(Protocol):
    def node(self, name: str) -> NodeInfo: ...

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> NodeInfo: ...

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> NodeInfo: ...


class PolicyTarget(Protocol):
    """What the labels change (InstanceService)."""

    def policy(self) -> NodePolicy: ...

    def set_node_policy(self, mode: NodeMode, placement: Placement) -> NodePolicy: ...


@dataclass(frozen=True)
class LabelPolicy:
    """What the labels ask for, and what in them could not be read."""

    mode: NodeMode
    placement: Placement
    problems: tuple[str, ...] = ()


def label_policy(labels: Mapping[str, str], configured: NodePolicy) -> LabelPolicy:
    """The mode and placement the Node's labels ask for; the configured ones
    where a label is absent or not a value cgpud knows (a problem)."""
    problems = []
    mode, placement = configured.mode, configured.placement
    text = labels.get(LABEL_MODE)
    if text is not None:
        try:
            mode = NodeMode(text.strip())
        except ValueError:
            names = ", ".join(m.value for m in NodeMode)
            problems.append(f"label {LABEL_MODE}={text!r} is not a mode cgpud knows ({names}): keeping {mode.value}")
    if mode is NodeMode.CORE_MEM and configured.max_instances_per_gpu > MAX_SCHEDULED:
        problems.append(
            f"label {LABEL_MODE}=core_mem needs max_instances_per_gpu of at most {MAX_SCHEDULED} "
            f"(the instances the compute scheduler takes per GPU; it is "
            f"{configured.max_instances_per_gpu}): keeping {configured.mode.value}"
        )
        mode = configured.mode
    text = labels.get(LABEL_PLACEMENT)
    if text is not None:
        try:
            placement = Placement(text.strip())
        except ValueError:
            problems.append(f"label {LABEL_PLACEMENT}={text!r} is not binpack or spread: keeping {placement.value}")
    return LabelPolicy(mode, placement, tuple(problems))


def card_label_patch(labels: Mapping[str, str], card: Mapping[str, str]) -> dict[str, str]:
    """The card-model labels that differ from what the Node carries."""
    return {k: v for k, v in card.items() if labels.get(k) != v}


def initial_policy(api: NodeSource | None, node: str, configured: NodePolicy) -> NodePolicy:
    """The policy to start with: the labels' when the API server answers
    now, else the config's (the sync loop catches up later). Read before the
    instance service starts, so a restart keeps a label-set mode even though
    a mode change with instances on the node would be refused."""
    if api is None:
        return configured
    try:
        wanted = label_policy(api.node(node).labels, configured)
    except CgpuError:
        return configured
    return replace(configured, mode=wanted.mode, placement=wanted.placement)


class NodeLabels:
    """Keeps the node's policy in step with its labels, and its card-model
    labels written. `sync()` is one round; `start()` runs rounds in a thread."""

    def __init__(
        self,
        api: NodeSource | None,
        node: str,
        target: PolicyTarget,
        configured: NodePolicy,
        card_labels: Mapping[str, str],
        on_policy: Callable[[NodePolicy], None] | None = None,
        interval: float = DEFAULT_INTERVAL,
        max_backoff: float = MAX_BACKOFF,
        unavailable: str = "",
    ) -> None:
        self._api = api
        self._node = node
        self._target = target
        self._configured = configured
        self._card = dict(card_labels)
        self._annotations: dict[str, str] = {}  # kept written on the Node (the Capacity API's address)
        self._on_policy = on_policy
        self._interval = interval
        self._max_backoff = max(max_backoff, interval)
        self._log = structlog.get_logger("cgpud.kube.node")
        self._said: set[str] = set()  # problems already logged, each said once while it lasts
        self._away = ""  # why the API server cannot be asked, "" while it answers
        self._thread: threading.Thread | None = None
        if api is None:
            self._offline(unavailable or "no API server client")

    @property
    def reachable(self) -> bool:
        return not self._away

    def sync(self) -> bool:
        """One round. True when the API server answered."""
        if self._api is None:
            return False
        try:
            info = self._api.node(self._node)
            patch = card_label_patch(info.labels, self._card)
            if patch:
                self._api.label_node(self._node, patch)
                self._log.info("card labels written", node=self._node, labels=patch)
            notes = {k: v for k, v in self._annotations.items() if info.annotations.get(k) != v}
            if notes:
                self._api.annotate_node(self._node, notes)
                self._log.info("node annotated", node=self._node, annotations=notes)
        except ApiServerUnavailable as e:
            self._offline(str(e))
            return False
        except ApiServerError as e:  # it answered, with a refusal: RBAC, no such node
            self._say(f"cannot read or label node {self._node}: {e}", error=True)
            return True
        if self._away:
            self._log.info("API server reachable again: following the node's labels", node=self._node)
            self._away = ""
        self._follow(info.labels)
        return True

    def annotate(self, annotations: Mapping[str, str]) -> NodeLabels:
        """Annotations each round keeps on the Node (written once, again
        whenever they differ). Call before start()."""
        self._annotations = dict(annotations)
        return self

    def start(self, stop: threading.Event) -> NodeLabels:
        self._thread = threading.Thread(target=self._run, args=(stop,), name="cgpud-node-labels", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- helpers ---------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        wait = self._interval
        while not stop.is_set():
            try:
                answered = self.sync()
            except Exception as e:  # the loop outlives any one round's bug; the next round tries again
                self._log.error("node label round failed", error=str(e), exc_info=True)
                answered = False
            wait = self._interval if answered else min(wait * 2, self._max_backoff)
            stop.wait(wait)

    def _follow(self, labels: Mapping[str, str]) -> None:
        wanted = label_policy(labels, self._configured)
        for problem in wanted.problems:
            self._say(problem, error=True)
        current = self._target.policy()
        if (wanted.mode, wanted.placement) == (current.mode, current.placement):
            return
        try:
            changed = self._target.set_node_policy(wanted.mode, wanted.placement)
        except CgpuError as e:
            self._say(f"node labels ask for mode {wanted.mode.value}, placement {wanted.placement.value}: {e}")
            return
        self._said.clear()
        self._log.info("node policy from labels", mode=changed.mode.value, placement=changed.placement.value)
        if self._on_policy is not None:
            self._on_policy(changed)

    def _offline(self, reason: str) -> None:
        if not self._away:
            policy = self._target.policy()
            self._log.warning(
                "API server cannot be reached: running on the configured mode and placement until it can",
                mode=policy.mode.value,
                placement=policy.placement.value,
                reason=reason,
            )
        self._away = reason or "unreachable"

    def _say(self, text: str, error: bool = False) -> None:
        if text in self._said:
            return
        self._said.add(text)
        (self._log.error if error else self._log.warning)(text, node=self._node)
