"""The bypass watchdog's I/O side and loop, fed recorded NVML answers: the
process lists merged per pid, the utilisation window weighted by time (a
bursty process is not fully busy), NVML's "no samples" and "not supported"
answers, a lost GPU skipped; the loop's mode gate, debounce of reports,
kills every round, its log lines, and a thread that survives a failing
round. The NVML answers are pynvml's own exception classes and record
shapes; the decision is bypass_policy's unless a test scripts it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from cgpud.node.bypass_model import BypassAction, BypassEvents, ComputeView, EventAction, GpuProcess, ProcessIdentity
from cgpud.node.bypass_model import Violation, ViolationKind, WatchSettings
from cgpud.node.compute import TenantMetrics
from cgpud.daemon.stats import DaemonStats
from cgpud.node.model import GIB, MIB, ComputePolicy, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner
from cgpud.node.model import OwnerKind
from cgpud.node.bypass_watchdog import BypassWatchdog, NvmlProcessReader
from tests.harness.wait import until

SECOND_US = 1_000_000


# ------------------------------------------------------------ recorded NVML


def proc(pid: int, used: int | None) -> Any:
    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)


def sample(pid: int, stamp_us: int, sm: int) -> Any:
    return SimpleNamespace(pid=pid, timeStamp=stamp_us, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)


@dataclass
class FakeNvml:
    """pynvml's surface as the reader uses it, answering from per-GPU
    scripts; errors are pynvml's classes."""

    compute: dict[int, list[Any]] = field(default_factory=dict)
    graphics: dict[int, list[Any]] = field(default_factory=dict)
    mps: dict[int, list[Any]] = field(default_factory=dict)
    # per GPU: the next answers of nvmlDeviceGetProcessUtilization (a list or an exception)
    util: dict[int, list[Any]] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)  # the process lists fail with this
    no_v3: bool = False
    no_mps: bool = False
    calls: list[tuple[str, int, Any]] = field(default_factory=list)
    shut: bool = False

    def __getattr__(self, name: str) -> Any:
        return getattr(pynvml, name)  # exception classes and constants

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def _list(self, table: dict[int, list[Any]], name: str, h: int) -> list[Any]:
        self.calls.append((name, h, None))
        if h in self.errors:
            raise self.errors[h]
        return list(table.get(h, []))

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        if self.no_v3:
            raise pynvml.NVMLError_FunctionNotFound()
        return self._list(self.compute, "compute", h)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: int) -> list[Any]:
        return self._list(self.compute, "compute_v2", h)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        if self.no_v3:
            raise pynvml.NVMLError_FunctionNotFound()
        return self._list(self.graphics, "graphics", h)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, h: int) -> list[Any]:
        return self._list(self.graphics, "graphics_v2", h)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h: int) -> list[Any]:
        if self.no_mps:
            raise pynvml.NVMLLibraryMismatchError("no MPS lists here")
        return self._list(self.mps, "mps", h)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, h: int) -> list[Any]:
        if self.no_mps:
            raise pynvml.NVMLError_FunctionNotFound()
        return self._list(self.mps, "mps_v2", h)

    def nvmlDeviceGetProcessUtilization(self, h: int, last_seen: int) -> list[Any]:
        self.calls.append(("util", h, last_seen))
        answers = self.util.get(h, [])
        answer = answers.pop(0) if answers else pynvml.NVMLError_NotFound()
        if isinstance(answer, Exception):
            raise answer
        return [s for s in answer if s.timeStamp > last_seen]


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def reader(nvml: FakeNvml, clock: Clock, gpus: Sequence[int] = (0,), window: float = 5.0) -> NvmlProcessReader:
    return NvmlProcessReader(gpus, window, nvml=nvml, clock=clock)


def by_pid(processes: list[GpuProcess]) -> dict[tuple[int, int], GpuProcess]:
    return {(p.gpu_index, p.pid): p for p in processes}


def test_lists_merge_per_pid_with_the_most_memory_listed():
    nvml = FakeNvml(
        compute={0: [proc(10, 1 * GIB), proc(11, None), proc(0, GIB)]},
        graphics={0: [proc(10, 2 * GIB), proc(12, 300 * MIB)]},
        mps={0: [proc(13, 5 * GIB)]},
    )
    r = reader(nvml, Clock())
    got = by_pid(r.read())
    # pid 0 is one NVML cannot name from here: nothing to map or kill
    assert set(got) == {(0, 10), (0, 11), (0, 12)}
    assert got[(0, 10)].used_bytes == 2 * GIB and got[(0, 11)].used_bytes is None
    assert got[(0, 10)].sm_percent is None  # the first round only starts the window
    assert by_pid(r.read(mps=True))[(0, 13)].used_bytes == 5 * GIB  # MPS clients only in mps mode


def test_old_drivers_are_read_through_the_v2_layout_and_missing_mps_lists_are_tolerated():
    nvml = FakeNvml(compute={0: [proc(10, GIB)]}, no_v3=True, no_mps=True)
    r = reader(nvml, Clock())
    with capture_logs() as logs:
        assert [p.pid for p in r.read(mps=True)] == [10]
        assert [p.pid for p in r.read(mps=True)] == [10]
    assert [c[0] for c in nvml.calls if c[0] != "util"] == ["compute_v2", "graphics_v2"] * 2
    assert len([x for x in logs if "MPS" in x["event"]]) == 1


def test_a_process_busy_in_bursts_is_averaged_over_time_not_over_its_samples():
    """A real driver samples every ~1/6 s and names only the processes busy
    in that period: pid 10 is busy 1 period in 3 at 90 %, pid 11 every
    period at 40 %. A mean over samples would say 90 % for pid 10."""
    clock = Clock()
    nvml = FakeNvml(compute={0: [proc(10, GIB), proc(11, GIB)]})
    r = reader(nvml, clock, window=3.0)
    r.read()
    start = int(clock.t * SECOND_US)
    period = SECOND_US // 6
    for second in range(3):
        answer = []
        for k in range(1, 7):
            stamp = start + second * SECOND_US + k * period
            answer.append(sample(11, stamp, 40))
            if k % 3 == 0:
                answer.append(sample(10, stamp, 90))
        nvml.util[0] = [answer]
        clock.t += 1
        got = by_pid(r.read())
    assert got[(0, 10)].sm_percent == pytest.approx(30, abs=1)
    assert got[(0, 11)].sm_percent == pytest.approx(40, abs=1)
    # the driver's period was learnt from the gaps; the reader asked for what came after the last sample
    assert nvml.calls[-1] == ("util", 0, start + SECOND_US + 6 * period)


def test_one_sample_per_round_as_the_simulator_gives_and_the_window_forgets():
    """The simulator answers one sample per process covering the time since
    lastSeen (at most 1 s). Old samples leave the window; idle rounds count
    as idle; a process never sampled has no figure (None)."""
    clock = Clock()
    nvml = FakeNvml(compute={0: [proc(10, GIB), proc(11, GIB)]})
    r = reader(nvml, clock, window=2.0)
    r.read()
    for _ in range(4):
        clock.t += 1
        nvml.util[0] = [[sample(10, int(clock.t * SECOND_US), 80)]]
        got = by_pid(r.read())
    assert got[(0, 10)].sm_percent == pytest.approx(80)
    assert got[(0, 11)].sm_percent is None
    clock.t += 1  # an idle round: NVML says "not found"
    assert by_pid(r.read())[(0, 10)].sm_percent == pytest.approx(40)
    clock.t += 1
    assert by_pid(r.read())[(0, 10)].sm_percent is None


def test_not_found_insufficient_size_and_not_supported():
    clock = Clock()
    nvml = FakeNvml(compute={0: [proc(10, GIB)], 1: [proc(20, GIB)]})
    r = reader(nvml, clock, gpus=(0, 1))
    r.read()
    clock.t += 1
    stamp = int(clock.t * SECOND_US)
    nvml.util = {0: [pynvml.NVMLError_InsufficientSize()], 1: [pynvml.NVMLError_NotSupported()]}
    with capture_logs() as logs:
        got = by_pid(r.read())
        # a process started between pynvml's two calls: no figure this round, the GPU still listed
        assert got[(0, 10)].used_bytes == GIB and got[(0, 10)].sm_percent is None
        assert got[(1, 20)].sm_percent is None and not r.compute_supported(1) and r.compute_supported(0)
        clock.t += 1
        nvml.util = {0: [[sample(10, stamp + SECOND_US, 50)]], 1: [[sample(20, stamp + SECOND_US, 50)]]}
        got = by_pid(r.read())
    assert got[(0, 10)].sm_percent is not None and got[(1, 20)].sm_percent is None
    assert ("util", 1, stamp - SECOND_US) in nvml.calls and not [c for c in nvml.calls[-4:] if c[:2] == ("util", 1)]
    assert len([x for x in logs if x["event"].startswith("the compute rule is off")]) == 1


def test_pynvml_raising_success_for_an_empty_answer_is_no_sample():
    clock = Clock()
    nvml = FakeNvml(compute={0: [proc(10, GIB)]})
    r = reader(nvml, clock)
    r.read()
    clock.t += 1
    nvml.util[0] = [pynvml.NVMLError(pynvml.NVML_SUCCESS)]
    assert by_pid(r.read())[(0, 10)].sm_percent is None


def test_a_lost_gpu_is_skipped_and_logged_once_per_change():
    clock = Clock()
    nvml = FakeNvml(compute={0: [proc(10, GIB)], 1: [proc(20, GIB)]})
    r = reader(nvml, clock, gpus=(0, 1))
    with capture_logs() as logs:
        nvml.errors[1] = pynvml.NVMLError_GpuIsLost()
        for _ in range(3):
            assert set(by_pid(r.read())) == {(0, 10)}  # never "GPU 1 is empty"
        nvml.errors[1] = pynvml.NVMLError_Unknown()
        r.read()
        del nvml.errors[1]
        assert set(by_pid(r.read())) == {(0, 10), (1, 20)}
        r.read()
    events = [(x["event"], x.get("error")) for x in logs]
    assert events == [
        ("the bypass watchdog skips a GPU NVML does not answer for", "GPU is lost"),
        ("the bypass watchdog skips a GPU NVML does not answer for", "Unknown Error"),
        ("the bypass watchdog reads a GPU again", None),
    ]
    r.close()
    assert nvml.shut and r.read() == []


# ------------------------------------------------------------ the loop


def instance(iid: str, *grants: tuple[int, int, int], pids: tuple[int, ...] = (100,)) -> Instance:
    return Instance(
        iid,
        Owner(OwnerKind.PROCESS, f"owner-{iid}"),
        tuple(Grant(g, f"GPU-{g}", mem, core) for g, mem, core in grants),
        InstanceState.BOUND,
        True,
        pids=pids,
        created=1.0,
        updated=1.0,
    )


@dataclass
class FakeService:
    instances: list[Instance]
    node: NodePolicy = field(default_factory=NodePolicy)
    engine: dict[str, list[TenantMetrics]] = field(default_factory=dict)

    def holdings(self) -> tuple[list[Instance], list[Any]]:
        return list(self.instances), []

    def policy(self) -> NodePolicy:
        return self.node

    def compute_metrics(self) -> dict[str, list[TenantMetrics]]:
        return self.engine


@dataclass
class FakeReader:
    rounds: list[list[GpuProcess]]
    window_s: float = 5.0
    reads: int = 0

    def read(self, mps: bool = False) -> list[GpuProcess]:
        self.reads += 1
        answer = self.rounds[min(self.reads - 1, len(self.rounds) - 1)]
        if isinstance(answer, Exception):
            raise answer
        return answer


@dataclass
class FakeMapper:
    owners: dict[int, str | None]

    def identify(self, pids: Sequence[int], instances: Sequence[Instance]) -> dict[int, ProcessIdentity]:
        return {
            p: ProcessIdentity(p, 1000 + p, f"/usr/bin/p{p}", "/user.slice", self.owners[p])
            for p in pids
            if p in self.owners
        }


@dataclass
class Kills:
    refuse: set[int] = field(default_factory=set)
    done: list[int] = field(default_factory=list)

    def __call__(
        self,
        identity: ProcessIdentity,
        mapper: Any,
        instances: Sequence[Instance],
        allow: Sequence[Any] = (),
        unknown: bool = False,
    ) -> tuple[bool, str]:
        assert allow == SETTINGS.allow and unknown == (identity.instance_id is None)
        if identity.pid in self.refuse:
            return False, f"pid {identity.pid} not killed: it now maps to another instance"
        self.done.append(identity.pid)
        return True, f"killed pid {identity.pid}"


SETTINGS = WatchSettings(memory_slack_bytes=0, compute_excess_percent=20.0, allow=(), isolating=False)
MEMORY = Violation(
    ViolationKind.MEMORY_OVER_LIMIT,
    0,
    "inst-a",
    (100, 101),
    used_bytes=4 * GIB,
    limit_bytes=GIB,
    detail="4 GiB held on GPU 0 against a 1 GiB limit",
)
UNKNOWN = Violation(
    ViolationKind.UNKNOWN_PROCESS, 0, "", (300,), used_bytes=GIB, detail="pid 300 belongs to no instance"
)


class Script:
    """A decision that says what the test says, recording what it was given."""

    def __init__(self, *rounds: list[Violation]) -> None:
        self.rounds = list(rounds)
        self.given: list[tuple[Any, ...]] = []

    def __call__(self, instances, processes, identities, compute, settings):  # type: ignore[no-untyped-def]
        self.given.append((instances, processes, identities, compute, settings))
        return self.rounds.pop(0) if len(self.rounds) > 1 else self.rounds[0]


def watchdog(
    service: FakeService,
    reader: FakeReader,
    decide: Any = None,
    action: BypassAction = BypassAction.REPORT,
    kill: Kills | None = None,
    owners: dict[int, str | None] | None = None,
    events: BypassEvents | None = None,
    **kw: Any,
) -> BypassWatchdog:
    return BypassWatchdog(
        service,
        events or BypassEvents(),
        reader,
        FakeMapper(owners or {100: "inst-a", 101: "inst-a"}),
        SETTINGS,
        action,
        0.01,
        decide=decide,
        kill=kill or Kills(),
        **kw,
    )


PROCS = [GpuProcess(0, 100, 2 * GIB), GpuProcess(0, 101, 2 * GIB)]


@pytest.mark.parametrize("mode", [NodeMode.DEFAULT, NodeMode.SHARE, NodeMode.TOPOLOGY])
def test_nothing_is_read_or_reported_where_the_mode_does_not_isolate(mode: NodeMode):
    service = FakeService([instance("inst-a", (0, GIB, 0))], NodePolicy(mode=mode))
    reader_ = FakeReader([PROCS])
    decide = Script([MEMORY])
    w = watchdog(service, reader_, decide)
    assert w.tick(10.0) == [] and reader_.reads == 0 and decide.given == []
    assert w.watching() == (False, f"mode {mode.value} does not isolate")
    service.node = NodePolicy(mode=NodeMode.CGPU)  # a label turned isolation on
    assert w.watching() == (True, "")
    assert [e.action for e in w.tick(11.0)] == [EventAction.REPORTED]
    assert decide.given[0][4].isolating  # the round's settings say so


def test_reports_once_when_it_appears_then_every_60_s_and_anew_after_it_ends():
    events = BypassEvents()
    decide = Script([MEMORY], [MEMORY], [MEMORY], [MEMORY], [], [MEMORY])
    w = watchdog(FakeService([instance("inst-a", (0, GIB, 0))]), FakeReader([PROCS]), decide, events=events)
    with capture_logs() as logs:
        got = [len(w.tick(t)) for t in (100.0, 101.0, 159.0, 160.5, 161.0, 162.0)]
    assert got == [1, 0, 0, 1, 0, 1]
    assert [e.time for e in events.recent()] == [100.0, 160.5, 162.0]
    assert events.count("inst-a") == 3
    line = logs[0]
    assert line == {
        "event": "bypass",
        "log_level": "warning",
        "kind": "memory_over_limit",
        "instance": "inst-a",
        "gpu": 0,
        "pids": [100, 101],
        "used": 4 * GIB,
        "limit": GIB,
        "action": "reported",
        "detail": MEMORY.detail,
    }


def test_kill_mode_kills_every_round_and_never_a_process_of_no_instance():
    kills = Kills()
    events = BypassEvents()
    decide = Script([MEMORY, UNKNOWN])
    w = watchdog(
        FakeService([instance("inst-a", (0, GIB, 0))]),
        FakeReader([PROCS + [GpuProcess(0, 300, GIB)]]),
        decide,
        BypassAction.KILL,
        kills,
        owners={100: "inst-a", 101: "inst-a", 300: None},
        events=events,
    )
    first = w.tick(100.0)
    second = w.tick(101.0)
    assert kills.done == [100, 101, 100, 101]
    assert [(e.violation.kind, e.action, e.killed) for e in first] == [
        (ViolationKind.MEMORY_OVER_LIMIT, EventAction.KILLED, (100, 101)),
        (ViolationKind.UNKNOWN_PROCESS, EventAction.REPORTED, ()),
    ]
    assert [(e.action, e.killed) for e in second] == [(EventAction.KILLED, (100, 101))]  # the report waits 60 s
    assert events.totals() == ({("memory_over_limit", "killed"): 2, ("unknown_process", "reported"): 1}, 4)


def test_with_kill_unknown_kill_mode_kills_processes_of_no_instance_too():
    """bypass_kill_unknown: a container that reached a GPU around cgpu (the
    toolkit honouring NVIDIA_VISIBLE_DEVICES=all) loses its process, every
    round it shows up, like an instance's offender."""
    from dataclasses import replace

    kills = Kills()
    w = BypassWatchdog(
        FakeService([instance("inst-a", (0, GIB, 0))]),
        BypassEvents(),
        FakeReader([PROCS + [GpuProcess(0, 300, GIB)]]),
        FakeMapper({100: "inst-a", 101: "inst-a", 300: None}),
        replace(SETTINGS, kill_unknown=True),
        BypassAction.KILL,
        0.01,
        decide=Script([UNKNOWN]),
        kill=kills,
    )
    first, second = w.tick(100.0), w.tick(101.0)
    assert kills.done == [300, 300]
    assert [(e.violation.kind, e.action, e.killed) for e in first + second] == [
        (ViolationKind.UNKNOWN_PROCESS, EventAction.KILLED, (300,))
    ] * 2


def test_a_kill_refused_by_the_safety_checks_is_an_event_saying_why():
    kills = Kills(refuse={101})
    three = Violation(
        ViolationKind.MEMORY_OVER_LIMIT,
        0,
        "inst-a",
        (100, 101, 102),
        used_bytes=6 * GIB,
        limit_bytes=GIB,
        detail="over",
    )
    w = watchdog(
        FakeService([instance("inst-a", (0, GIB, 0))]),
        FakeReader([PROCS]),
        Script([three]),
        BypassAction.KILL,
        kills,
        owners={100: "inst-a", 101: "inst-a"},
    )  # 102 was not identified
    with capture_logs() as logs:
        [event] = w.tick(100.0)
    assert event.action is EventAction.KILL_FAILED and event.killed == (100,) and kills.done == [100]
    assert event.detail == (
        "killed pid 100; pid 101 not killed: it now maps to another instance; pid 102 not killed: not identified"
    )
    assert logs[0]["action"] == "kill_failed" and logs[0]["killed"] == [100]
    assert logs[0]["detail"] == "over" and logs[0]["outcome"] == event.detail


def test_compute_views_follow_the_policy_per_gpu_and_average_the_engine_over_the_window():
    inst = instance("inst-a", (0, GIB, 30), (1, GIB, 30), (2, GIB, 0))
    node = NodePolicy(
        mode=NodeMode.CORE_MEM, compute_policy=ComputePolicy.FIXED, gpu_compute_policies=((1, ComputePolicy.NATIVE),)
    )
    service = FakeService([inst], node)
    decide = Script([])
    w = watchdog(service, FakeReader([PROCS], window_s=2.0), decide)
    for t, pct in ((100.0, 20), (101.0, 40), (102.0, 60), (103.0, 80)):
        service.engine = {"inst-a": [TenantMetrics(0, 0, 0, 0, 100, pct, 100_000)]}
        w.tick(t)
    views = {v.gpu_index: v for v in decide.given[-1][3]}
    assert views[0] == ComputeView("inst-a", 0, 30, True, pytest.approx(70))  # 102 and 103: the 2 s window
    assert not views[1].caps and not views[2].caps  # native policy; no share asked
    service.node = NodePolicy(mode=NodeMode.CGPU, compute_policy=ComputePolicy.FIXED)  # nothing schedules compute
    w.tick(104.0)
    assert not any(v.caps for v in decide.given[-1][3])


def test_the_thread_survives_a_failing_round_and_times_each_round():
    reader_ = FakeReader([RuntimeError("NVML went away"), PROCS])
    stats = DaemonStats()
    w = watchdog(FakeService([instance("inst-a", (0, GIB, 0))]), reader_, Script([MEMORY]), stats=stats)
    stop = threading.Event()
    with capture_logs() as logs:
        thread = w.start(stop)
        try:
            until(lambda: reader_.reads >= 3, timeout=10, interval=0.01, what="three rounds of NVML reads")
        finally:
            stop.set()
            thread.join(5)
    assert not thread.is_alive() and reader_.reads >= 3
    assert any(x["event"] == "bypass round failed" and "NVML went away" in x["error"] for x in logs)
    assert [x for x in logs if x["event"] == "bypass"]  # later rounds still report
    buckets, _ = stats.snapshot()[2]["bypass"]
    assert buckets[-1][1] >= 3


def test_a_round_with_the_real_decision():
    """bypass_policy.decide behind the loop: the instance past its limit
    plus slack is reported, its well-behaved neighbour is not, a node
    daemon on the default allow list is not, a stray process is."""
    from cgpud.node.bypass_policy import DEFAULT_ALLOW

    service = FakeService(
        [instance("inst-a", (0, GIB, 0), pids=(100,)), instance("inst-b", (0, 2 * GIB, 0), pids=(200,))]
    )
    procs = [
        GpuProcess(0, 100, 3 * GIB),
        GpuProcess(0, 200, 2 * GIB + 500 * MIB),
        GpuProcess(0, 300, 200 * MIB),
        GpuProcess(0, 301, GIB),
    ]
    mapper = FakeMapper({100: "inst-a", 200: "inst-b", 300: None, 301: None})
    mapper.identify = lambda pids, inst: {  # type: ignore[method-assign]
        p: ProcessIdentity(
            p, 1, "/usr/bin/nvidia-persistenced" if p == 300 else f"/usr/bin/p{p}", "/", mapper.owners[p]
        )
        for p in pids
    }
    events = BypassEvents()
    w = BypassWatchdog(
        service,
        events,
        FakeReader([procs]),
        mapper,
        WatchSettings(512 * MIB, 20.0, DEFAULT_ALLOW, isolating=False),
        BypassAction.REPORT,
        1.0,
        kill=Kills(),
    )
    got = w.tick(100.0)
    assert [(e.violation.kind, e.violation.instance_id, e.violation.pids) for e in got] == [
        (ViolationKind.MEMORY_OVER_LIMIT, "inst-a", (100,)),
        (ViolationKind.UNKNOWN_PROCESS, "", (301,)),
    ]
    assert got[0].violation.used_bytes == 3 * GIB and got[0].violation.limit_bytes == GIB


def test_the_instances_are_read_after_nvml_so_a_new_tenant_is_not_unknown():
    """An instance is committed before its process starts: a tenant that
    starts between the two reads of a round must find its instance."""
    from cgpud.node.bypass_policy import DEFAULT_ALLOW

    service = FakeService([])
    new = instance("inst-new", (0, GIB, 0), pids=(100,))

    class Starting(FakeReader):
        def read(self, mps: bool = False) -> list[GpuProcess]:
            service.instances.append(new)  # created, then its process listed by NVML
            return [GpuProcess(0, 100, 200 * MIB)]

    w = BypassWatchdog(
        service,
        BypassEvents(),
        Starting([]),
        FakeMapper({100: "inst-new"}),
        WatchSettings(512 * MIB, 20.0, DEFAULT_ALLOW, isolating=False),
        BypassAction.REPORT,
        1.0,
        kill=Kills(),
    )
    assert w.tick(100.0) == []
