"""GPU health for the device plugin: the decision (pure), then the watcher
on the simulated GPUs, with faults injected by `cgpuctl sim fault` from
another process. The watcher runs in a subprocess because pynvml finds
libnvidia-ml.so.1 through LD_LIBRARY_PATH, fixed when a process starts."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from cgpud.errors import UsageError
from cgpud.kube.health import DEFAULT_SKIPPED_XIDS, GpuHealth, HealthPolicy, HealthWatcher, ProbeObserved, XidObserved
from cgpud.kube.health import apply, decide, healthy_by_index, parse_xids
from tests.harness.simrun import py_env, sim_stat
from tests.harness.sim_fault import inject_fault

POLICY = HealthPolicy(recovery_window=60.0)
GPU = GpuHealth(1, "GPU-1", changed_at=0.0)

# ---- the decision ---------------------------------------------------------


def test_nvidias_application_xids_are_skipped():
    assert DEFAULT_SKIPPED_XIDS == {13, 31, 43, 45, 68, 109}
    for xid in DEFAULT_SKIPPED_XIDS:
        assert decide(GPU, XidObserved(1, xid, 5.0), POLICY) == GPU


def test_a_fatal_xid_makes_the_gpu_unhealthy_with_its_name():
    after = decide(GPU, XidObserved(1, 48, 5.0), POLICY)
    assert (after.healthy, after.reason, after.changed_at) == (False, "fatal XID 48 (double-bit ECC error)", 5.0)
    assert decide(GPU, XidObserved(1, 222, 5.0), POLICY).reason == "fatal XID 222"


def test_a_configured_xid_is_skipped_too():
    policy = HealthPolicy.build(extra_skipped=[94], recovery_window=60.0)
    assert decide(GPU, XidObserved(1, 94, 5.0), policy) == GPU
    assert not decide(GPU, XidObserved(1, 95, 5.0), policy).healthy


def test_xids_to_skip_are_read_from_a_setting():
    assert parse_xids("48, 94 119") == {48, 94, 119}
    assert parse_xids("") == frozenset()
    for bad in ("48 x", "0", "1000", "-5"):
        with pytest.raises(UsageError, match="XIDs must be numbers from 1 to 999"):
            parse_xids(bad)


@pytest.mark.parametrize(("extra", "window"), [([0], 60.0), ([1000], 60.0), ([], -1.0)])
def test_a_bad_policy_is_refused(extra, window):
    with pytest.raises(UsageError):
        HealthPolicy.build(extra_skipped=extra, recovery_window=window)


def test_an_xid_clears_after_the_recovery_window_without_another():
    bad = decide(GPU, XidObserved(1, 48, 10.0), POLICY)
    assert not decide(bad, ProbeObserved(1, 69.9), POLICY).healthy
    again = decide(bad, XidObserved(1, 62, 50.0), POLICY)  # a new fatal XID restarts the window
    assert not decide(again, ProbeObserved(1, 100.0), POLICY).healthy
    healed = decide(again, ProbeObserved(1, 110.0), POLICY)
    assert (healed.healthy, healed.reason, healed.changed_at) == (True, "", 110.0)


def test_with_no_window_only_a_reset_recovers_an_xid():
    policy = HealthPolicy(recovery_window=0.0)
    bad = decide(GPU, XidObserved(1, 48, 10.0), policy)
    assert not decide(bad, ProbeObserved(1, 1e9), policy).healthy
    lost = decide(bad, ProbeObserved(1, 20.0, lost=True), policy)
    assert lost.reason == "GPU is lost"
    reset = decide(lost, ProbeObserved(1, 30.0), policy)
    assert (reset.healthy, reset.fatal_xid) == (True, None)


def test_a_lost_gpu_is_unhealthy_until_it_answers_again():
    lost = decide(GPU, ProbeObserved(1, 3.0, lost=True), POLICY)
    assert (lost.healthy, lost.reason, lost.changed_at) == (False, "GPU is lost", 3.0)
    still = decide(lost, XidObserved(1, 79, 4.0), POLICY)
    assert (still.reason, still.changed_at) == ("GPU is lost", 3.0)  # the verdict did not change
    back = decide(still, ProbeObserved(1, 9.0), POLICY)
    assert (back.healthy, back.reason, back.changed_at) == (True, "", 9.0)


def test_an_xid_79_is_a_lost_gpu_whose_next_answer_is_its_reset():
    """The XID comes by event within milliseconds; a GPU reset before the
    next probe must not stay Unhealthy for the whole recovery window."""
    gone = decide(GPU, XidObserved(1, 79, 3.0), POLICY)
    assert (gone.healthy, gone.reason) == (False, "GPU is lost")
    back = decide(gone, ProbeObserved(1, 3.2), POLICY)
    assert (back.healthy, back.reason, back.fatal_xid) == (True, "", None)


def test_a_probe_that_fails_otherwise_is_unhealthy_but_keeps_the_xid():
    bad = decide(GPU, XidObserved(1, 48, 1.0), POLICY)
    odd = decide(bad, ProbeObserved(1, 2.0, failure="Unknown Error"), POLICY)
    assert odd.reason == "NVML cannot query the GPU: Unknown Error"
    assert decide(odd, ProbeObserved(1, 3.0), POLICY).reason == "fatal XID 48 (double-bit ECC error)"


def test_apply_changes_only_the_observed_gpu():
    snap = {0: GpuHealth(0, "GPU-0"), 1: GPU}
    after = apply(snap, XidObserved(1, 79, 2.0), POLICY)
    assert after[0] == snap[0] and not after[1].healthy
    assert apply(snap, XidObserved(7, 79, 2.0), POLICY) == snap
    assert healthy_by_index(after) == {0: True, 1: False}


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"probe_interval": 0}, "probe interval"), ({"wait_ms": 0}, "event wait")]
)
def test_watcher_settings_are_checked(kwargs, message):
    with pytest.raises(UsageError, match=message):
        HealthWatcher([], lambda _: None, **kwargs)


# ---- the watcher on simulated GPUs ------------------------------------------

WATCHER = """
import json, sys, time
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries the JSON lines
from cgpud.node.inventory import read_inventory
from cgpud.kube.health import HealthPolicy, HealthWatcher

def show(snap):
    return {str(i): [h.healthy, h.reason] for i, h in sorted(snap.items())}

def on_change(snap):
    print(json.dumps({"t": time.monotonic(), "gpus": show(snap)}), flush=True)

policy = HealthPolicy.build(extra_skipped=[94], recovery_window=float(sys.argv[1]))
w = HealthWatcher(read_inventory().gpus, on_change, policy=policy, probe_interval=0.2, wait_ms=200).start()
print(json.dumps({"ready": show(w.snapshot())}), flush=True)
sys.stdin.readline()
t = time.monotonic()
w.stop()
print(json.dumps({"stopped": time.monotonic() - t, "gpus": show(w.snapshot())}), flush=True)
"""


class Watcher:
    """The watcher's subprocess and its lines as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the watcher in {timeout}s") from None

    def until(self, what: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next(max(0.01, deadline - time.monotonic()))
            if what(line):
                return line

    def quiet(self, seconds: float) -> None:
        time.sleep(seconds)
        assert self.lines.empty(), self.lines.get()

    def stop(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.until(lambda line: "stopped" in line, 10.0)


def start_watcher(sim_env: dict[str, str], recovery_window: float) -> Watcher:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WATCHER), str(recovery_window)],
        env=py_env(sim_env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    watcher = Watcher(proc)
    ready = watcher.next(30.0)
    assert ready == {"ready": {"0": [True, ""], "1": [True, ""]}}
    return watcher


def inject(sim_env: dict[str, str], *args: str) -> float:
    """`cgpuctl sim fault ARGS` in its own process; the monotonic time it
    returned."""
    inject_fault(sim_env, *args)
    return time.monotonic()


def unhealthy(gpu: str, reason: str) -> Callable[[dict[str, Any]], bool]:
    return lambda line: line.get("gpus", {}).get(gpu) == [False, reason]


@pytest.fixture
def watcher_factory(sim_env: dict[str, str]) -> Iterator[Callable[[float], Watcher]]:
    started: list[Watcher] = []

    def make(recovery_window: float) -> Watcher:
        started.append(start_watcher(sim_env, recovery_window))
        return started[-1]

    yield make
    for w in started:
        w.proc.kill()
        w.proc.wait()


def test_a_fatal_xid_is_unhealthy_at_once_and_healthy_after_the_window(sim_env, watcher_factory):
    w = watcher_factory(1.5)
    posted = inject(sim_env, "--gpu", "1", "--xid", "48")
    line = w.next(5.0)
    assert line["gpus"] == {"0": [True, ""], "1": [False, "fatal XID 48 (double-bit ECC error)"]}
    assert line["t"] - posted < 1.0  # woken by the event, not by a probe or a timeout
    healed = w.next(5.0)
    assert healed["gpus"] == {"0": [True, ""], "1": [True, ""]}
    assert 1.4 <= healed["t"] - line["t"] < 2.5  # the window, plus at most a probe interval
    assert w.stop()["stopped"] < 1.5


def test_application_and_configured_xids_change_nothing(sim_env, watcher_factory):
    w = watcher_factory(300.0)
    for xid in ("13", "31", "43", "45", "68", "109", "94"):  # NVIDIA's list, and 94 from the config
        inject(sim_env, "--gpu", "0", "--xid", xid)
    w.quiet(0.8)
    inject(sim_env, "--gpu", "1", "--xid", "95")  # a fatal one, to show the watcher was listening
    assert w.next(5.0)["gpus"] == {"0": [True, ""], "1": [False, "fatal XID 95 (uncontained ECC error)"]}
    assert w.stop()["gpus"]["0"] == [True, ""]


def test_a_lost_gpu_is_unhealthy_until_reset(sim_env, watcher_factory):
    w = watcher_factory(300.0)  # longer than the test: only the reset can heal it
    posted = inject(sim_env, "--gpu", "1", "--lost")
    line = w.until(unhealthy("1", "GPU is lost"), 5.0)
    assert line["gpus"]["0"] == [True, ""] and line["t"] - posted < 1.5
    w.quiet(0.6)  # stays lost: no flapping while the GPU is off the bus
    recovered = inject(sim_env, "--gpu", "1", "--recover")
    back = w.next(5.0)
    assert back["gpus"] == {"0": [True, ""], "1": [True, ""]}
    assert back["t"] - recovered < 1.0  # within a probe interval or so
    # XIDs are watched again after the reset.
    inject(sim_env, "--gpu", "1", "--xid", "48")
    assert w.next(5.0)["gpus"]["1"] == [False, "fatal XID 48 (double-bit ECC error)"]
    assert w.stop()["stopped"] < 1.5


def test_a_gpu_lost_before_the_watcher_starts_is_unhealthy_from_the_start(native, sim_env):
    uuids = [g["uuid"] for g in sim_stat(native, sim_env)["gpus"]]
    inject(sim_env, "--gpu", "0", "--lost")
    script = textwrap.dedent("""
        import json, sys
        from cgpud.kube.health import HealthWatcher
        class G:
            def __init__(self, index, uuid):
                self.index, self.uuid = index, uuid
        calls = []
        w = HealthWatcher([G(i, u) for i, u in enumerate(sys.argv[1:])], calls.append, probe_interval=0.2,
                          wait_ms=100).start()
        snap = w.snapshot()
        w.stop()
        print(json.dumps({"gpus": {i: [h.healthy, h.reason] for i, h in snap.items()}, "calls": len(calls)}))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script, *uuids], env=py_env(sim_env), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    # The first verdict is the snapshot's; on_change hears of changes only.
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "gpus": {"0": [False, "GPU is lost"], "1": [True, ""]},
        "calls": 0,
    }


def test_snapshot_before_start_is_all_healthy():
    gpus = [replace(GPU, index=0, uuid="GPU-0"), GPU]
    w = HealthWatcher(gpus, lambda _: None)
    assert healthy_by_index(w.snapshot()) == {0: True, 1: True}
    w.stop()  # never started: nothing to stop


def test_the_daemon_settings_make_the_policy(tmp_path):
    from cgpud import config

    empty = tmp_path / "config.toml"
    empty.write_text("")
    settings = config.load(
        empty, {"gpu_health_skip_xids": "48,94", "gpu_health_recovery_window": "0", "gpu_health_probe_interval": "2.5"}
    )
    assert settings.health_policy() == HealthPolicy(DEFAULT_SKIPPED_XIDS | {48, 94}, 0.0)
    assert settings.gpu_health_probe_interval == 2.5
    assert config.DaemonConfig().health_policy() == HealthPolicy()
    for bad, message in [
        ({"gpu_health_skip_xids": "48 x"}, "XIDs must be numbers"),
        ({"gpu_health_recovery_window": "-1"}, "recovery window"),
        ({"gpu_health_probe_interval": "0"}, "gpu_health_probe_interval"),
    ]:
        with pytest.raises(UsageError, match=message):
            config.load(empty, bad)
