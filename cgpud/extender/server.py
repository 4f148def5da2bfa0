"""The extender's HTTP face, as kube-scheduler calls it (extender v1 JSON, Go
field names): POST /filter, /prioritize, /bind, GET /healthz, /inspect.

Filter and prioritize only read the cluster state; bind is the only verb
that changes anything. A request that is not what kube-scheduler sends gets
HTTP 400 with {"Error": "..."} naming what is wrong, and changes nothing.

With TLS and a client CA (kube-scheduler's extender tlsConfig), the verbs
(filter, prioritize, bind) need a client certificate that CA signed;
/healthz and the read-only /inspect do not. The server is bounded (boundedhttp.py):
connections, idle time, and the bytes of bodies held at once.
"""

from __future__ import annotations

import gc
import json
import random
import socket
import socketserver
import ssl
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from operator import itemgetter
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

import orjson
import structlog

from cgpud.boundedhttp import BoundedHandler, BoundedServer, Bounds
from cgpud.errors import CgpuError, UsageError
from cgpud.extender.bind import Assignment, BindArgs
from cgpud.extender.fit import NodeSummary, Placement, Reason, Rendered, render, rendered
from cgpud.extender.model import view_to_json
from cgpud.extender.pod import PodDemand, PodError, pod_demand
from cgpud.extender.state import ClusterState
from cgpud.extender.wire import cut_node_names

MAX_BODY = 16 << 20
BOUNDS = Bounds(max_connections=64, idle_timeout=30.0, body_budget=64 << 20)
# Nodes one request may name: above the largest clusters kube-scheduler
# serves, and a bound on the answer (an unknown node's reason is ~170 bytes:
# a million names in 5 MiB would otherwise ask for a 170 MB answer).
MAX_NODES = 20_000
RECENT_SHAPES = 16  # pod shapes answered ahead on each new node view
MEMOS = 64  # (pod shape, node list) answers kept: a filter and a prioritize list per recent shape
# Node lists kept by the text they came as (Extender.parse): as many as
# answers are kept, and at most these bytes of text together.
LIST_TEXTS_BYTES = 32 << 20
# Pods' demands kept by the text they came as: a pod's prioritize follows
# its filter with the same Pod text. Few: a pod is filtered once a cycle.
POD_TEXTS = 16
POD_TEXT_BYTES = 256 << 10  # a longer one is not kept (16 of them: at most 4 MiB)
_log = structlog.get_logger("cgpud.extender")


class Binder(Protocol):
    def remember(self, demand: PodDemand) -> None: ...
    def picked(self, demand: PodDemand, node: str, placement: Placement) -> None: ...
    def bind(self, args: BindArgs) -> Assignment: ...
    def recent(self) -> list[dict[str, Any]]: ...


class BadRequest(ValueError):
    pass


FILTER, PRIORITIZE, BIND = "filter", "prioritize", "bind"


# Per verb, the Rendered fields its answer is joined from.
_FIELDS = {FILTER: (2, 3, 4), PRIORITIZE: (5,)}


BLOCK = 64  # pieces joined together: a node whose answer changed re-joins its block, not the whole list


@dataclass
class _Judged:
    """Every node's Rendered answer for one pod shape and node list, and per
    verb the lists of pieces its answer joins, joined in blocks of BLOCK
    nodes: a node whose view changed swaps its own pieces and its block is
    joined again, and an answer no piece of which changed is the same bytes
    again."""

    judged: list[Rendered]
    pieces: dict[str, list[list[str]]] = field(default_factory=dict)  # by verb, made when first asked
    blocks: dict[str, list[list[str | None]]] = field(default_factory=dict)  # by verb, each list's blocks joined
    joined: dict[str, list[str | None]] = field(default_factory=dict)  # by verb, each list joined (None: redo)
    texts: dict[str, bytes] = field(default_factory=dict)  # by verb, the whole answer until a piece changes
    best: list[int] | None = None  # the placed nodes of the highest score, by place; None: find again
    top: int = -1  # their score (-1: none placed)

    def set(self, i: int, new: Rendered) -> None:
        old = self.judged[i]
        self.judged[i] = new
        if self.best is not None:
            self._rebest(i, new.answer)
        for verb, lists in self.pieces.items():
            for k, f in enumerate(_FIELDS[verb]):
                piece = cast(str, new[f])
                if old[f] != piece:  # a node that still passes the filter leaves its answer as it was
                    lists[k][i] = piece
                    self.blocks[verb][k][i // BLOCK] = None
                    self.joined[verb][k] = None
                    self.texts.pop(verb, None)

    def text(self, verb: str) -> bytes:
        text = self.texts.get(verb)
        if text is not None:
            return text
        lists = self.pieces.get(verb)
        if lists is None:
            lists = self.pieces[verb] = [list(map(itemgetter(f), self.judged)) for f in _FIELDS[verb]]
            self.blocks[verb] = [[None] * -(-len(self.judged) // BLOCK) for _ in lists]
            self.joined[verb] = [None] * len(lists)
        joined = self.joined[verb]
        for k, value in enumerate(joined):
            if value is None:
                blocks, pieces = self.blocks[verb][k], lists[k]
                for b, block in enumerate(blocks):
                    if block is None:  # the empty pieces skipped, in C
                        blocks[b] = ",".join(filter(None, pieces[b * BLOCK : (b + 1) * BLOCK]))
                joined[k] = ",".join(filter(None, blocks))
        if verb == FILTER:
            ok, bad, never = joined
            whole = (
                f'{{"Nodes":null,"NodeNames":[{ok}],"FailedNodes":{{{bad}}},'
                f'"FailedAndUnresolvableNodes":{{{never}}},"Error":""}}'
            )
        else:
            whole = f"[{joined[0]}]"
        self.texts[verb] = text = whole.encode()
        return text

    def none_passed(self) -> bool:
        """Whether no node's answer is a placement: the filter's NodeNames
        are joined from the placed nodes' pieces, and only theirs are not
        empty (read from the joined text: counting would read every piece
        again)."""
        self.text(FILTER)
        return not self.joined[FILTER][0]

    def best_placed(self) -> list[int]:
        """The places of the nodes whose placement scores highest (empty
        when none is placed)."""
        if self.best is None:
            top, best = -1, []
            for i, r in enumerate(self.judged):
                answer = r.answer
                if not isinstance(answer, Placement):
                    continue
                if answer.score > top:
                    top, best = answer.score, [i]
                elif answer.score == top:
                    best.append(i)
            self.best, self.top = best, top
        return self.best

    def _rebest(self, i: int, answer: Placement | Reason) -> None:
        """best_placed after node i's answer changed: kept in step (a bind
        changes one node; at 1,000 nodes a scan of all is ~0.1 ms)."""
        best = self.best
        assert best is not None
        score = answer.score if isinstance(answer, Placement) else -1
        if i in best:
            if score > self.top:
                self.best, self.top = [i], score
            elif score < self.top:
                if len(best) > 1:
                    best.remove(i)
                else:
                    self.best = None  # the best fell: scan again
        elif score > self.top:
            self.best, self.top = [i], score
        elif score == self.top and score >= 0:
            best.append(i)

    def picked_text(self, i: int) -> bytes:
        """The filter's answer passing only the node at place `i` (which
        is placed): the refused nodes as in the whole answer."""
        self.text(FILTER)
        _, bad, never = self.joined[FILTER]
        return (
            f'{{"Nodes":null,"NodeNames":[{self.judged[i].passed}],"FailedNodes":{{{bad}}},'
            f'"FailedAndUnresolvableNodes":{{{never}}},"Error":""}}'
        ).encode()


class _Names(tuple[str, ...]):
    """A node list that computes its hash once (a tuple's is computed at
    every look-up: 1,000 names each time)."""

    _hash: int

    def __new__(cls, names: Sequence[str]) -> _Names:
        self = super().__new__(cls, names)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash


class _Texts(NamedTuple):
    """A filter or prioritize body as it came, cut (wire.Cut): NodeNames's
    text, and the rest's."""

    names: bytes
    rest: bytes


@dataclass
class _Memo:
    generation: int  # ClusterState.generation the answers are from
    index: dict[str, int]  # node name -> its place in the list
    judged: _Judged
    demand: PodDemand  # one pod of the shape, to answer a node's new view


UNKNOWN_NODE = (
    "unknown to cgpu-scheduler: no Capacity address for this node (not in the node file, or no "
    "cgpu.io/capacity-address annotation: cgpud's capacity_listen is off there)"
)


class Extender:
    """The verbs as functions of parsed JSON (the HTTP layer is below).

    pick_at_filter: the filter passes a GPU-share pod only the node
    prioritize would score highest (ties drawn at random), so that
    kube-scheduler, left one feasible node, binds there without scoring:
    one round trip fewer a pod, and kube-scheduler's own scores no longer
    weigh in (docs/scheduler.md)."""

    def __init__(
        self,
        state: ClusterState,
        binder: Binder | None,
        unknown_node: str = UNKNOWN_NODE,
        pick_at_filter: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        self.state = state
        self.binder = binder
        self.unknown_node = unknown_node
        self.pick_at_filter = pick_at_filter
        self._rng = rng if rng is not None else random.Random()
        # Requests answered per verb, for /inspect (with --pick-at-filter,
        # kube-scheduler sends no prioritize for the pods it places).
        self._answered = dict.fromkeys((FILTER, PRIORITIZE, BIND), 0)
        self._answered_lock = threading.Lock()
        # Nodes the node source knows are not cgpu nodes, with why.
        self._skipped: dict[str, str] = {}
        # Per (pod shape, node list): every node's answer, kept across
        # requests; a request redoes only the nodes written since
        # (ClusterState.changed_since). kube-scheduler sends the same node
        # list pod after pod, and a bind changes one node.
        self._memos: OrderedDict[tuple[Any, _Names], _Memo] = OrderedDict()
        self._memo_lock = threading.Lock()
        self._once: OrderedDict[tuple[Any, _Names], None] = OrderedDict()  # seen once, not kept yet
        # The last pod shapes filtered, one demand each: a node's new view is
        # answered for them as it arrives (warm), so the next pod of a
        # recent shape finds every node's answer ready.
        self._recent: OrderedDict[Any, PodDemand] = OrderedDict()  # by PodDemand.fit_key
        self._recent_lock = threading.Lock()
        # Node lists that passed _args's checks (see _checked_before).
        self._checked: OrderedDict[_Names, _Names] = OrderedDict()
        self._checked_lock = threading.Lock()
        # The same lists by the JSON text they came as (see parse), and
        # the bytes of those texts.
        self._texts: OrderedDict[bytes, _Names] = OrderedDict()
        self._texts_bytes = 0
        # Demands by the text of the body without NodeNames (see parse).
        self._pods: OrderedDict[bytes, PodDemand | PodError] = OrderedDict()

    @property
    def skipped(self) -> dict[str, str]:
        return self._skipped

    @skipped.setter
    def skipped(self, reasons: dict[str, str]) -> None:
        with self._memo_lock:
            self._skipped = dict(reasons)
            self._memos.clear()  # their unknown nodes' reasons may have changed

    def _answer(
        self, verb: str, demand: PodDemand, names: _Names, then: list[Callable[[], None]] | None = None
    ) -> dict[str, Any] | bytes:
        """The verb's answer as JSON text, from the memo of this shape and
        node list when there is one (redoing only the nodes written since;
        the same text again when none was). `then`: see filter."""
        if verb == FILTER and self.pick_at_filter and not demand.whole:
            pick: list[tuple[str, Placement]] = []
            text = self._judged(demand, names, lambda judged: self._picked(names, judged, pick))
            if pick:  # outside the memos' lock: the hold writes the node's record
                self._hold_pick(demand, *pick[0], then)
            return text
        return self._judged(demand, names, lambda judged: self._text(verb, names, judged))

    def _hold_pick(
        self, demand: PodDemand, node: str, placement: Placement, then: list[Callable[[], None]] | None
    ) -> None:
        if self.binder is None:
            return
        if then is None:
            self.binder.picked(demand, node, placement)
        else:
            binder = self.binder
            then.append(lambda: binder.picked(demand, node, placement))

    def _judged(
        self, demand: PodDemand, names: _Names, answer: Callable[[_Judged], dict[str, Any] | bytes]
    ) -> dict[str, Any] | bytes:
        """`answer` of every node's judgement of the pod, from the memo (see
        _answer); called under the memos' lock, which guards the judgement."""
        key = (demand.fit_key, names)
        with self._memo_lock:
            memo = self._memos.get(key)
            if memo is not None:
                generation, changed = self.state.changed_since(memo.generation)
                # Most of the nodes changed (a burst of views): one pass over all is cheaper.
                if changed is not None and len(changed) <= max(len(memo.index) // 4, 16):
                    judged = memo.judged
                    for name in changed:
                        i = memo.index.get(name)
                        if i is not None:
                            judged.set(i, self._judge_all(demand, (name,))[0])
                    memo.generation = generation
                    self._memos.move_to_end(key)
                    return answer(judged)
            generation = self.state.generation  # before the nodes are read: a later write is redone next time
            judged = _Judged(self._judge_all(demand, names))
            if memo is None and key not in self._once:
                # Kept from its second time on: kube-scheduler may send a
                # different sample of nodes for every pod.
                self._once[key] = None
                while len(self._once) > 4 * MEMOS:
                    self._once.popitem(last=False)
                return answer(judged)
            self._once.pop(key, None)
            self._memos[key] = _Memo(generation, {name: i for i, name in enumerate(names)}, judged, demand)
            self._memos.move_to_end(key)
            while len(self._memos) > MEMOS:
                self._memos.popitem(last=False)
            return answer(judged)

    def _text(self, verb: str, names: Sequence[str], judged: _Judged) -> dict[str, Any] | bytes:
        if verb == FILTER and judged.none_passed():
            later = self._retry_later(names, judged.judged)
            if later is not None:
                return later
        return judged.text(verb)

    def _picked(
        self, names: Sequence[str], judged: _Judged, pick: list[tuple[str, Placement]]
    ) -> dict[str, Any] | bytes:
        """The filter's answer with the best node alone, appended to `pick`
        with its placement."""
        i = self._best(judged)
        if i is None:
            return self._text(FILTER, names, judged)
        pick.append((names[i], cast(Placement, judged.judged[i].answer)))
        return judged.picked_text(i)

    def _best(self, judged: _Judged) -> int | None:
        """The place of a node of the highest score (ties drawn at random),
        or None when none is placed."""
        best = judged.best_placed()
        if not best:
            return None
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def patch(self, name: str, summary: NodeSummary | None, generation: int) -> None:
        """A node's record was replaced (write `generation`): each kept
        answer that was current takes the node's new answer now, where the
        view arrives, so that after a burst of views the next pod finds its
        answers current instead of judging every node on the request path.
        Best effort: when a request holds the answers (and may be waiting
        for the writers' lock in changed_since) nothing is patched, and the
        answers that fall behind catch up on their next request as before."""
        if summary is None or not self._memo_lock.acquire(blocking=False):
            return
        try:
            for memo in self._memos.values():
                if memo.generation != generation - 1:
                    continue  # behind already: its next request catches it up
                i = memo.index.get(name)
                if i is not None:
                    hit = summary.rendered.get(memo.demand.fit_key)
                    memo.judged.set(i, hit if hit is not None else rendered(memo.demand, summary))
                memo.generation = generation
        finally:
            self._memo_lock.release()

    def warm(self, summary: NodeSummary) -> None:
        """Answer the recent pod shapes on a node summary not yet published."""
        with self._recent_lock:
            demands = list(self._recent.values())
        for demand in demands:
            rendered(demand, summary)

    def _seen(self, demand: PodDemand) -> None:
        shape = demand.fit_key
        with self._recent_lock:
            if shape in self._recent:
                self._recent.move_to_end(shape)
                return
            self._recent[shape] = demand
            while len(self._recent) > RECENT_SHAPES:
                self._recent.popitem(last=False)

    def parse(self, raw: bytes) -> tuple[Any, _Texts | None]:
        """A filter or prioritize body as orjson parses it, and NodeNames's
        JSON text and the rest's when the body could be cut there
        (wire.cut_node_names).
        A node list whose very text passed the checks before comes as the
        list kept then, unparsed: at 5,000 nodes parsing, hashing and
        comparing the names was most of a warm pod's work. Raises
        orjson.JSONDecodeError for a body that is not JSON."""
        cut = cut_node_names(raw)
        if cut is None:
            return orjson.loads(raw), None
        with self._checked_lock:
            kept = self._texts.get(cut.names)
            if kept is not None:
                self._texts.move_to_end(cut.names)
        try:
            body = orjson.loads(cut.pod)
            names = kept if kept is not None else orjson.loads(cut.names)
        except orjson.JSONDecodeError:
            return orjson.loads(raw), None
        if not isinstance(body, dict) or not body or "NodeNames" in body:
            return orjson.loads(raw), None
        body["NodeNames"] = names
        return body, _Texts(cut.names, cut.pod)

    def _args(self, body: Any, texts: _Texts | None = None) -> tuple[PodDemand | PodError, _Names, list[Any] | None]:
        """(demand or why the pod cannot be placed, node names, node objects
        when given as Nodes). `texts`: NodeNames and the rest as sent (see parse)."""
        if not isinstance(body, dict):
            raise BadRequest(f"ExtenderArgs must be a JSON object, not {_kind(body)}")
        pod = body.get("Pod")
        if pod is None:
            raise BadRequest("ExtenderArgs has no Pod")
        names_text = texts.names if texts is not None else None
        rest = texts.rest if texts is not None else None
        names = body.get("NodeNames")
        nodes = body.get("Nodes")
        items: list[Any] | None = None
        if names is not None:
            if type(names) is _Names:  # kept by parse: checked before
                return self._demand_of(pod, rest), names, None
            if not isinstance(names, list):
                raise BadRequest("ExtenderArgs.NodeNames must be a list of node names")
            known = self._known(names)
            if known is not None:
                self._keep_text(names_text, known)
                return self._demand_of(pod, rest), known, None
            if not set(map(type, names)) <= {str}:
                raise BadRequest("ExtenderArgs.NodeNames must be a list of node names")
        elif nodes is not None:
            if not isinstance(nodes, dict) or not isinstance(nodes.get("items") or [], list):
                raise BadRequest("ExtenderArgs.Nodes must be a v1.NodeList object with an items list")
            items = nodes.get("items") or []
            names = []
            for i, n in enumerate(items):
                name = n.get("metadata", {}).get("name") if isinstance(n, dict) else None
                if not isinstance(name, str) or not name:
                    raise BadRequest(f"ExtenderArgs.Nodes.items[{i}] has no metadata.name")
                names.append(name)
        else:
            raise BadRequest("ExtenderArgs has neither NodeNames (nodeCacheCapable) nor Nodes")
        if len(names) > MAX_NODES:
            raise BadRequest(
                f"ExtenderArgs names {len(names)} nodes: cgpu-scheduler takes at most {MAX_NODES} a request"
            )
        if len(set(names)) != len(names):
            raise BadRequest("ExtenderArgs names a node more than once")
        key = _Names(names)
        if items is None:
            with self._checked_lock:
                self._checked[key] = key
                while len(self._checked) > 4 * MEMOS:
                    self._checked.popitem(last=False)
            self._keep_text(names_text, key)
        return self._demand_of(pod, rest), key, items

    def _demand_of(self, pod: Any, text: bytes | None) -> PodDemand | PodError:
        """The pod's demand, kept by `text` (the body without NodeNames, which
        holds the Pod) for the verb that follows with the same pod."""
        if text is None or len(text) > POD_TEXT_BYTES:
            return self._demand(pod)
        with self._checked_lock:
            kept = self._pods.get(text)
        if kept is not None:
            return kept
        demand = self._demand(pod)  # BadRequest: nothing kept
        with self._checked_lock:
            self._pods[text] = demand
            while len(self._pods) > POD_TEXTS:
                self._pods.popitem(last=False)
        return demand

    def _keep_text(self, text: bytes | None, names: _Names) -> None:
        """Find `names` by `text`, the JSON it came as, from now on."""
        if text is None or len(text) > LIST_TEXTS_BYTES:
            return
        with self._checked_lock:
            if text in self._texts:
                return
            self._texts[text] = names
            self._texts_bytes += len(text)
            while len(self._texts) > MEMOS or self._texts_bytes > LIST_TEXTS_BYTES:
                old, _ = self._texts.popitem(last=False)
                self._texts_bytes -= len(old)

    def _known(self, names: list[str]) -> _Names | None:
        """The list kept when this very list of names passed the checks
        before, else None. kube-scheduler sends the same list pod after pod,
        and checking 1,000 names costs more than finding them; the kept
        list is then the key of the answers kept for it, found by identity.
        A list equal to one that passed is strings alone, each once (JSON
        makes no str subclasses)."""
        try:
            probe = _Names(names)
        except TypeError:  # an unhashable item: not names
            return None
        with self._checked_lock:
            kept = self._checked.get(probe)
            if kept is not None:
                self._checked.move_to_end(kept)
            return kept

    @staticmethod
    def _demand(pod: Any) -> PodDemand | PodError:
        try:
            return pod_demand(pod)
        except PodError as e:
            if not isinstance(pod, dict) or not isinstance(pod.get("metadata"), dict):
                raise BadRequest(f"ExtenderArgs.Pod: {e}") from None
            return e

    def _judge_all(self, demand: PodDemand, names: Sequence[str]) -> list[Rendered]:
        """For each node in order, fit's answer with the node's pieces of the
        answers (Rendered): the hot loop."""
        record = self.state.records.get
        answers = self.state.answers.get
        shape = demand.fit_key
        out: list[Rendered] = []
        append = out.append
        for name in names:
            kept = answers(name)
            if kept is not None:
                hit = kept.get(shape)
                if hit is not None:
                    append(hit)
                    continue
            rec = record(name)
            summary = rec.summary if rec is not None else None
            if summary is None:
                append(render(self._missing(name, rec), json.dumps(name)))
                continue
            hit = summary.rendered.get(shape)
            append(hit if hit is not None else rendered(demand, summary))
        return out

    def _missing(self, name: str, rec: Any) -> Reason:
        if rec is None:
            return Reason(self.skipped.get(name, self.unknown_node), resolvable=False)
        if not rec.entry.connected:
            return Reason(
                f"cgpud's Capacity stream is down ({rec.entry.error}); the node is avoided until it is back",
                resolvable=False,
                transient=True,
            )
        return Reason("no view from the node's cgpud yet", resolvable=False, transient=True)

    @staticmethod
    def _retry_later(names: Sequence[str], judged: Sequence[Rendered]) -> dict[str, Any] | None:
        """When no node fits and some only because its cgpud is not reached
        yet: an Error, not a filter result. kube-scheduler parks a pod an
        extender filtered out until some cluster event, and a cgpud coming
        back is none (up to 5 minutes in an idle cluster, seen on v1.37); an
        error puts it in the backoff queue, retried within 10 s."""
        if any(type(r.answer) is not Reason for r in judged):
            return None
        waiting = [
            f"{n}: {r.answer.text}"
            for n, r in zip(names, judged)
            if isinstance(r.answer, Reason) and r.answer.transient
        ]
        if not waiting:
            return None
        return {
            "Error": "no node fits the pod now, and cgpu-scheduler cannot see all of them yet; "
            f"kube-scheduler retries it: {'; '.join(waiting)}"
        }

    def filter(
        self, body: Any, texts: _Texts | None = None, then: list[Callable[[], None]] | None = None
    ) -> dict[str, Any] | bytes:
        """`then`: where to leave the work of holding a pick (--pick-at-filter)
        for after the answer is sent, off kube-scheduler's one scheduling
        loop; the next filter on the same connection comes after it. None:
        done before this returns."""
        demand, names, items = self._args(body, texts)
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        passed: list[str] = []
        if isinstance(demand, PodError):
            unresolvable = dict.fromkeys(names, str(demand))
        elif not demand.containers:
            passed = list(names)  # no GPU share asked: not this extender's business
        else:
            if self.binder is not None:
                self.binder.remember(demand)
            self._seen(demand)
            if items is None:  # the node cache's answer, built as text from the nodes' rendered parts
                return self._answer(FILTER, demand, names, then)
            judged = self._judge_all(demand, names)
            later = self._retry_later(names, judged)
            if later is not None:
                return later
            for name, r in zip(names, judged):
                answer = r.answer
                if type(answer) is Reason:
                    (failed if answer.resolvable else unresolvable)[name] = answer.text
                else:
                    passed.append(name)
            i = self._best(_Judged(judged)) if self.pick_at_filter and not demand.whole else None
            if i is not None:
                passed = [names[i]]
                self._hold_pick(demand, names[i], cast(Placement, judged[i].answer), then)
        out: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}
        if items is None:
            out["Nodes"] = None
            out["NodeNames"] = passed
        else:
            keep = set(passed)
            out["Nodes"] = {"metadata": {}, "items": [n for n in items if n["metadata"]["name"] in keep]}
            out["NodeNames"] = None
        return out

    def prioritize(self, body: Any, texts: _Texts | None = None) -> list[dict[str, Any]] | dict[str, Any] | bytes:
        demand, names, _ = self._args(body, texts)
        if isinstance(demand, PodError) or not demand.containers:
            return [{"Host": n, "Score": 0} for n in names]
        if self.binder is not None:
            self.binder.remember(demand)
        return self._answer(PRIORITIZE, demand, names)

    def bind(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadRequest(f"ExtenderBindingArgs must be a JSON object, not {_kind(body)}")
        fields = {}
        for key in ("PodName", "PodNamespace", "PodUID", "Node"):
            value = body.get(key, "")
            if not isinstance(value, str):
                raise BadRequest(f"ExtenderBindingArgs.{key} must be a string")
            fields[key] = value
        for key in ("PodName", "Node"):
            if not fields[key]:
                raise BadRequest(f"ExtenderBindingArgs has no {key}")
        args = BindArgs(fields["PodName"], fields["PodNamespace"] or "default", fields["PodUID"], fields["Node"])
        if self.binder is None:
            return {"Error": "this cgpu-scheduler does not bind"}
        try:
            self.binder.bind(args)
        except CgpuError as e:
            _log.warning("bind failed", pod=f"{args.pod_namespace}/{args.pod_name}", node=args.node, error=str(e))
            return {"Error": str(e)}
        return {"Error": ""}

    def answered(self, verb: str) -> None:
        with self._answered_lock:
            self._answered[verb] += 1

    def inspect(self) -> dict[str, Any]:
        out = view_to_json(self.state.view())
        with self._answered_lock:
            out["requests"] = dict(self._answered)
        out["pick_at_filter"] = self.pick_at_filter
        if self.binder is not None:
            out["recent_binds"] = self.binder.recent()
        return out


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(type(value), "a number")


@dataclass(frozen=True)
class ServerTls:
    """The extender's serving certificate and key, and the CA whose client
    certificates may call it (None: any client, TLS only for privacy)."""

    cert: Path
    key: Path
    client_ca: Path | None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca is not None:
                ctx.load_verify_locations(cafile=str(self.client_ca))
                # optional at the handshake so /healthz needs none; checked per path
                ctx.verify_mode = ssl.CERT_OPTIONAL
        except (OSError, ssl.SSLError) as e:
            raise UsageError(f"cannot load the extender's TLS files: {e}") from e
        return ctx


# /healthz for the kubelet's probes; /inspect (read-only) for
# `kubectl inspect cgpu` through the API server's service proxy, which
# presents no client certificate (the NetworkPolicy and the API server's
# RBAC on services/proxy decide who reaches it).
OPEN_PATHS = ("/healthz", "/inspect")


# Request heads: http.server's bounds (a line of 64 KiB, 100 header lines).
MAX_LINE = 65536
MAX_HEADERS = 100


class _Handler(BoundedHandler, socketserver.StreamRequestHandler):
    """HTTP/1.1 with keep-alive, read by hand: http.server's handler parses
    every request's head with the email package and builds the answer's
    head a header at a time, which was half of a filter's CPU at 1,000
    nodes. What is read here: the request line, Content-Length,
    Connection and Expect; a body comes only with a Content-Length."""

    server: _Http
    close_connection: bool = True
    path: str = ""

    def setup(self) -> None:
        super().setup()
        # Answers are small and the connection is reused: without this a
        # reply can wait for the peer's delayed ACK (~40 ms).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self) -> None:
        self.close_connection = False
        while not self.close_connection:
            try:
                self._one()
            except OSError:  # the peer went away, timed out, or was cut (TLS errors included)
                return
            finally:
                self.answered()

    def _send(self, code: int, body: Any) -> None:
        data = body if isinstance(body, bytes) else orjson.dumps(body)  # bytes: JSON already
        close = "Connection: close\r\n" if self.close_connection else ""
        head = (
            f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{close}\r\n"
        )
        # Head and body in one write.
        self.wfile.write(head.encode("ascii") + data)

    def _refuse(self, code: int, error: str) -> None:
        """An answer after which the connection's bytes cannot be trusted to
        be at a request's start: closed."""
        self.close_connection = True
        self._send(code, {"Error": error})

    def _one(self) -> None:
        line = self.rfile.readline(MAX_LINE + 1)
        if not line:
            self.close_connection = True
            return
        if len(line) > MAX_LINE:
            self._refuse(414, f"request line longer than {MAX_LINE} bytes")
            return
        words = line.split()
        if len(words) != 3 or not words[2].startswith(b"HTTP/"):
            self._refuse(400, f"bad request line {line[:200]!r}")
            return
        method, version = words[0], words[2]
        self.path = words[1].decode("latin-1")
        if version not in (b"HTTP/1.1", b"HTTP/1.0"):
            self._refuse(505, f"HTTP version {version[:20]!r}: HTTP/1.1 is spoken here")
            return
        keep = version == b"HTTP/1.1"
        length: bytes | None = None
        chunked = expect = False
        for _ in range(MAX_HEADERS + 1):
            line = self.rfile.readline(MAX_LINE + 1)
            if len(line) > MAX_LINE:
                self._refuse(431, f"header line longer than {MAX_LINE} bytes")
                return
            if line in (b"\r\n", b"\n", b""):
                break
            name, colon, value = line.partition(b":")
            if not colon:
                self._refuse(400, f"bad header line {line[:200]!r}")
                return
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                if length is not None and length != value:
                    self._refuse(400, "two different Content-Length headers")
                    return
                length = value
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                keep = b"close" not in tokens and (keep or b"keep-alive" in tokens)
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"expect":
                expect = value.lower() == b"100-continue"
        else:
            self._refuse(431, f"more than {MAX_HEADERS} header lines")
            return
        if not line:  # the peer closed inside the head
            self.close_connection = True
            return
        self.close_connection = not keep
        if chunked:
            self._refuse(411, "a request body needs a Content-Length (no Transfer-Encoding)")
        elif method == b"GET":
            if length not in (None, b"0"):
                self.close_connection = True  # a body nobody reads: the next request cannot be found
            self._get()
        elif method == b"POST":
            self._post(length, expect)
        else:
            self._refuse(501, f"no {method[:20].decode('latin-1')} here: GET /healthz, /inspect; POST the verbs")

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _caller_refused(self, path: str) -> bool:
        """Without a client certificate the client CA signed, only /healthz."""
        if not self.server.client_certs or path in OPEN_PATHS:
            return False
        conn = self.connection
        if isinstance(conn, ssl.SSLSocket) and conn.getpeercert():
            return False
        self._refuse(
            403,
            f"{path} needs a client certificate signed by the extender's client CA "
            "(kube-scheduler's extender tlsConfig certFile/keyFile)",
        )
        return True

    def _get(self) -> None:
        path = self._path()
        self.answering()
        if self._caller_refused(path):
            return
        if path == "/healthz":
            self._send(200, {"status": "ok"})
        elif path == "/inspect":
            self._send(200, json.dumps(self.server.extender.inspect(), separators=(",", ":")).encode())
        else:
            self._send(404, {"Error": f"no GET {path}: use /healthz or /inspect"})

    def _post(self, length_text: bytes | None, expect: bool) -> None:
        path = self._path()
        extender = self.server.extender
        verbs: dict[str, Callable[[Any, _Texts | None], Any]] = {
            FILTER: extender.filter,
            PRIORITIZE: extender.prioritize,
            BIND: lambda body, _: extender.bind(body),
        }
        if length_text is None:
            self._refuse(411, "a request body needs a Content-Length")
            return
        length = int(length_text) if length_text.isdigit() else -1
        if length < 0 or length > MAX_BODY:
            text = length_text[:40].decode("latin-1")
            self._refuse(413, f"request body of {text} bytes: at most {MAX_BODY} are read")
            return
        if self._caller_refused(path):
            return
        verb = verbs.get(path[1:]) if path.startswith("/") else None
        if expect:
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        with self.body(length) as raw:
            self.answering()
            if raw is None:
                self._refuse(503, "too many request bodies in flight: try again")
                return
            if verb is None:
                self._send(404, {"Error": f"no POST {path}: use /filter, /prioritize or /bind"})
                return
            try:
                body, texts = extender.parse(raw) if verb is not verbs[BIND] else (orjson.loads(raw), None)
            except orjson.JSONDecodeError as e:
                self._send(400, {"Error": f"{path}: the body is not JSON ({e})"})
                return
        then: list[Callable[[], None]] = []
        try:
            answer = extender.filter(body, texts, then) if verb is verbs[FILTER] else verb(body, texts)
        except BadRequest as e:
            self._send(400, {"Error": f"{path}: {e}"})
            return
        except Exception as e:  # a bug: say so, keep serving
            _log.exception("extender verb failed", verb=path)
            self._send(500, {"Error": f"{path}: internal error: {e!r}"})
            return
        extender.answered(path[1:])
        self._send(200, answer)
        for step in then:
            try:
                step()
            except Exception:  # a bug: say so, keep the connection (its next request is kube-scheduler's)
                _log.exception("holding the filter's pick failed", verb=path)


class _Http(BoundedServer, socketserver.TCPServer):
    allow_reuse_address = True
    request_queue_size = 128
    bounds = BOUNDS

    def __init__(
        self,
        address: tuple[str, int],
        extender: Extender,
        tls: ssl.SSLContext | None = None,
        client_certs: bool = False,
        bounds: Bounds = BOUNDS,
    ) -> None:
        self.extender = extender
        self.bounds = bounds
        self.client_certs = client_certs
        super().__init__(address, _Handler)
        if tls is not None:
            # The handshake runs in the connection's thread, bounded like a
            # request, never in the accepting one.
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)


class _Http6(_Http):
    address_family = socket.AF_INET6


# QuietHeap's full collections: the first a minute after the start; each
# that finds (almost) no cyclic garbage doubles the wait for the next, up
# to LONGEST_COLLECT_WAIT; one that finds some brings it back to the minute.
COLLECT_EVERY = 60.0
LONGEST_COLLECT_WAIT = 960.0
LITTLE_GARBAGE = 1000  # unreachable objects a full collection may find and still be "almost none"


def next_collect_wait(wait: float, found: int, every: float, longest: float, little: int = LITTLE_GARBAGE) -> float:
    """Seconds until QuietHeap's next full collection, after one that found
    `found` unreachable objects, `wait` seconds after the one before. A full
    collection walks the whole heap with the GIL held (measured here: 55 ms
    at 1,000 nodes, 230 ms at 5,000, finding nothing), so it is spaced out
    while there is nothing to find, and comes back to `every` as soon as
    there is."""
    if found > little:
        return every
    return min(max(wait, every) * 2, longest)


class QuietHeap:
    """Keeps CPython's cyclic garbage collector off the request path.

    The cluster view is a large heap of long-lived objects (every node's
    view), and a full collection walks all of it: tens of milliseconds at
    1,000 nodes, paid by whichever request allocates at the wrong moment.
    So the heap is frozen (gc.freeze: O(1), the objects leave the
    collector's generations; reference counting still frees them) after
    every write to the view, and thawed, collected and frozen again from a
    thread of its own, so cyclic garbage that got frozen is reclaimed: the
    first time `collect_every` after the start, then further apart while
    the collections find (almost) nothing (next_collect_wait), at most
    `longest` apart. The view itself makes no cycles; a full collection at
    5,000 nodes held the GIL for 230 ms here, once a minute."""

    def __init__(
        self, state: ClusterState, collect_every: float = COLLECT_EVERY, longest: float = LONGEST_COLLECT_WAIT
    ) -> None:
        self._state = state
        self._every = collect_every
        self._longest = max(longest, collect_every)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="extender-gc", daemon=True)

    def start(self) -> QuietHeap:
        self._state.on_write = gc.freeze
        gc.freeze()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._state.on_write = None
        gc.unfreeze()

    def _run(self) -> None:
        wait = self._every
        while not self._stop.wait(wait):
            gc.unfreeze()
            found = gc.collect()
            gc.freeze()
            wait = next_collect_wait(wait, found, self._every, self._longest)


class ExtenderServer:
    def __init__(
        self,
        state: ClusterState,
        binder: Binder | None,
        host: str = "127.0.0.1",
        port: int = 0,
        unknown_node: str = UNKNOWN_NODE,
        quiet_gc: bool = True,
        tls: ServerTls | None = None,
        bounds: Bounds = BOUNDS,
        pick_at_filter: bool = False,
    ) -> None:
        self.extender = Extender(state, binder, unknown_node, pick_at_filter)
        self._tls = tls
        self._bounds = bounds
        self._host = host
        self._want_port = port
        self._http: _Http | None = None
        self._thread: threading.Thread | None = None
        self._heap = QuietHeap(state) if quiet_gc else None
        self._state = state

    @property
    def port(self) -> int:
        assert self._http is not None, "not started"
        return self._http.server_address[1]

    @property
    def url(self) -> str:
        host = self._host if ":" not in self._host else f"[{self._host}]"
        return f"{'https' if self._tls else 'http'}://{host}:{self.port}"

    def start(self) -> ExtenderServer:
        cls = _Http6 if ":" in self._host else _Http
        context = self._tls.context() if self._tls is not None else None
        client_certs = self._tls is not None and self._tls.client_ca is not None
        self._http = cls((self._host, self._want_port), self.extender, context, client_certs, self._bounds)
        self._http.start_reaper()
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="extender-http", daemon=True
        )
        self._thread.start()
        self._state.on_summary = self.extender.warm
        self._state.on_put = self.extender.patch
        if self._heap is not None:
            self._heap.start()
        return self

    def stop(self) -> None:
        if self._http is None:
            return
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._heap is not None:
            self._heap.stop()
        self._state.on_summary = None
        self._state.on_put = None
        self._http = None
