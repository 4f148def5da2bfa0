"""cgpud stops on SIGTERM whichever of its threads the kernel hands the
signal to. kill(2) on a thread's id still signals the whole process but
delivers to that thread; the kernel does the same when the main thread
cannot take a signal at that moment. cgpud used to wait for its stop Event
in the main thread with the handler setting it: a SIGTERM that landed on
another thread left the main thread asleep in that wait for good (seen in
CI as a cgpud that never said STOPPING=1)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.harness.daemon import running_daemon


def other_threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_delivered_to_any_thread_stops_cgpud(
    tmp_path: Path, sim_env: dict[str, str], signum: signal.Signals
) -> None:
    with running_daemon(tmp_path, sim_env, "--mode", "cgpu", "--bypass-interval", "0.2") as d:
        assert d.proc is not None
        threads = other_threads(d.proc.pid)
        assert len(threads) >= 3, threads  # sweeper, bypass watchdog, gRPC, relay...
        os.kill(threads[len(threads) // 2], signum)
        d.wait_for(b"STOPPING=1", timeout=10)
        assert d.proc.wait(timeout=30) == 0
        assert '"event": "stopping"' in d.log.read_text()


def test_a_stop_signal_during_start_up_is_kept(tmp_path: Path, sim_env: dict[str, str]) -> None:
    """SIGTERM right after READY=1 (the teardown of a short test): still a clean stop."""
    for round_ in range(5):
        (tmp_path / str(round_)).mkdir()
        with running_daemon(tmp_path / str(round_), sim_env) as d:
            assert d.proc is not None
            d.proc.send_signal(signal.SIGTERM)
            d.wait_for(b"STOPPING=1", timeout=10)
            assert d.proc.wait(timeout=30) == 0
