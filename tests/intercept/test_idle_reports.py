"""libcgpu.so says when a process holding its instance's grant has nothing
left to run (an idle report in its ledger's fence_ack, cgpu/region.h), so
that cgpud can pass the GPU on before the slice ends; its next launch takes
the report back. The test plays cgpud on the grants file and drives a real
program's driver calls one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cgpud._region import lib
from tests.harness.simrun import start_py
from tests.harness.grants import GATE_OPEN, GrantsView, closed, opened
from tests.harness.wait import until

IDLE, DRAINED, LAUNCHED = int(lib.CGPU_ACK_IDLE), int(lib.CGPU_ACK_DRAINED), int(lib.CGPU_ACK_LAUNCHED)

PROGRAM = """
import ctypes as C, sys; from cudapy import Driver
cu = Driver(); cu.init_device()
fn = cu.spin_function()
stream, other, event = C.c_void_p(), C.c_void_p(), cu.event()
cu.call("cuStreamCreate", C.byref(stream), 0)
cu.call("cuStreamCreate", C.byref(other), 0)
print("ready", flush=True)
for line in sys.stdin:
    what = line.split()
    if what[0] == "launch":
        cu.launch_spin(fn, int(what[1]), stream)
    elif what[0] == "launch-other":
        cu.launch_spin(fn, int(what[1]), other)
    elif what[0] == "ctxsync":
        cu.call("cuCtxSynchronize")
    elif what[0] == "streamsync":
        cu.call("cuStreamSynchronize", stream)
    elif what[0] == "streamsync-other":
        cu.call("cuStreamSynchronize", other)
    elif what[0] == "eventsync":
        cu.call("cuEventRecord", event, stream)
        cu.call("cuEventSynchronize", event)
    elif what[0] == "query":
        print(cu.rc("cuStreamQuery", stream), flush=True)
        continue
    print("ok", flush=True)
"""


class Program:
    """A CUDA program under libcgpu that does what the test tells it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = start_py(env, PROGRAM)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            raise AssertionError(f"the program ended: {self.proc.communicate(timeout=10)[1]}")
        return line

    def do(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)


@pytest.fixture
def program(gated) -> Iterator[tuple[Program, GrantsView]]:
    env, region = gated([opened(1)])
    p = Program(env)
    yield p, region
    p.stop()


def report(seq_word: int, drained: bool) -> int:
    return (seq_word & ~GATE_OPEN) | IDLE | (DRAINED if drained else 0)


def fence_and_grant_again(p: Program, region: GrantsView) -> None:
    """cgpud closes the gate (sequence 2) after p launched, p fences, and
    the gate opens again (3): p's watcher reports the new grant idle."""
    close_gate_and_await_fence(p, region)
    open_gate_and_await_idle_report(p, region)


def close_gate_and_await_fence(p: Program, region: GrantsView) -> None:
    """cgpud closes the gate (sequence 2) after p launched; p fences."""
    region.set_gate(0, closed(2))
    until(lambda: region.fence_ack(p.pid) == closed(2) | LAUNCHED, 5.0, interval=0.005, what="the fence")


def open_gate_and_await_idle_report(p: Program, region: GrantsView) -> None:
    """The gate opens again (sequence 3): p's watcher reports the grant idle."""
    region.set_gate(0, opened(3))
    until(
        lambda: region.fence_ack(p.pid) == report(opened(3), True),
        5.0,
        interval=0.005,
        what="the watcher's idle report",
    )


@pytest.mark.parametrize("sync, drained", [("ctxsync", True), ("streamsync", False), ("eventsync", False)])
def test_a_synchronisation_with_nothing_launched_since_reports_the_grant_idle(program, sync, drained):
    p, region = program
    assert p.do("launch 2000000") == "ok"
    before, bell = region.fence_ack(p.pid), region.bell()
    assert before is not None and not before & IDLE
    assert p.do(sync) == "ok"
    # Only a context synchronisation knows the whole queue is empty.
    assert region.fence_ack(p.pid) == report(opened(1), drained)
    assert region.bell() == bell + 1
    assert p.do("launch 1000") == "ok"
    assert region.fence_ack(p.pid) == before, "the next launch did not take the report back"


def test_one_stream_of_several_is_no_idleness(program):
    """A process that queued work into two streams and synchronises one (or
    an event, whose stream libcgpu does not know) may still have the other's
    work queued: no report. Passed over there, it would wait out the
    neighbour's slice, and a long kernel of the neighbour's, with its own
    work still queued. Its context synchronisation still reports."""
    p, region = program
    assert p.do("launch 1000") == "ok"
    assert p.do("launch-other 2000000") == "ok"
    before, bell = region.fence_ack(p.pid), region.bell()
    for sync in ("streamsync", "eventsync", "streamsync-other"):
        assert p.do(sync) == "ok"
        assert region.fence_ack(p.pid) == before and region.bell() == bell, sync
    assert p.do("ctxsync") == "ok"
    assert region.fence_ack(p.pid) == report(opened(1), True)


def test_after_a_fence_one_stream_is_idleness_again(program):
    """The queue is empty after a fence: from there, work in one stream
    again makes that stream's synchronisation an idle report, and another
    stream's not."""
    p, region = program
    assert p.do("launch 1000") == "ok"
    assert p.do("launch-other 1000") == "ok"
    fence_and_grant_again(p, region)
    assert p.do("launch 1000000") == "ok"
    assert p.do("streamsync-other") == "ok"
    assert region.fence_ack(p.pid) == closed(2) | LAUNCHED, "the other stream's synchronisation said idle"
    assert p.do("streamsync") == "ok"
    assert region.fence_ack(p.pid) == report(opened(3), False)


def test_a_query_that_finds_the_work_done_reports_too(program):
    p, region = program
    # 300 ms: the first query must come before the kernel ends, even on a
    # machine busy enough to leave this process off its core for a while.
    assert p.do("launch 300000000") == "ok"
    assert p.do("query") == "CUDA_ERROR_NOT_READY"
    assert not region.fence_ack(p.pid) & IDLE
    until(lambda: p.do("query") == "CUDA_SUCCESS", 5.0, interval=0.005, what="the kernel to finish")
    assert region.fence_ack(p.pid) == report(opened(1), False)


def test_a_grant_to_a_process_with_nothing_launched_since_its_fence_is_idle_from_the_start(program):
    p, region = program
    assert p.do("launch 1000000") == "ok"
    fence_and_grant_again(p, region)
    assert p.do("launch 1000") == "ok"
    assert region.fence_ack(p.pid) == closed(2) | LAUNCHED


def test_no_report_while_the_gate_is_closed_or_over_a_later_closings_acknowledgement(program):
    p, region = program
    assert p.do("launch 1000") == "ok"
    close_gate_and_await_fence(p, region)
    assert p.do("ctxsync") == "ok"
    assert region.fence_ack(p.pid) == closed(2) | LAUNCHED  # a closed gate is no grant to be idle in
    # An acknowledgement newer than the open grant (as a race with a closing
    # would leave) is never replaced by a report for the older grant.
    open_gate_and_await_idle_report(p, region)
    assert p.do("launch 1000") == "ok"
    region.usage.proc[0].fence_ack[0] = closed(4)
    assert p.do("ctxsync") == "ok"
    assert region.fence_ack(p.pid) == closed(4)
