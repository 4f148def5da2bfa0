"""cgpuctl while cgpud is down: it says so once, waits for cgpud to come back
(as long as the relays for commands that change something, shorter for
reads), and fails with a clear message when it does not. Real cgpuctl and
cgpud processes on the simulated GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cgpud.contract import RELAY_WAIT_S
from tests.harness.daemon import Daemon, make_daemon
from tests.harness.wait import until
from tests.harness.workload import instances

BIN = Path(sys.executable).parent


def _cgpuctl(socket: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "cgpuctl"), "--socket", str(socket), *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_run_started_while_cgpud_is_down_waits_for_it(tmp_path, sim_env):
    d = make_daemon(tmp_path, sim_env)
    (tmp_path / "run").mkdir(exist_ok=True)
    proc = _cgpuctl(d.socket, d.env, "run", "--mem", "1GiB", "--", "sh", "-c", "echo tenant ran")
    try:
        time.sleep(1.0)
        assert proc.poll() is None, proc.communicate()
        d.start()
        out, err = proc.communicate(timeout=RELAY_WAIT_S + 20)
        assert proc.returncode == 0, err
        assert out == "tenant ran\n"
        assert err == (
            f"cgpuctl: cgpud is not running ({d.socket}: No such file or directory); retrying for {RELAY_WAIT_S} s\n"
        )
        # The tenant's instance was made and released by the daemon that came up.
        listed = d.cgpuctl("list", "--all", "--output", "json")
        assert listed.returncode == 0 and '"state": "released"' in listed.stdout, listed.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
        d.stop()


def _ids_in(d: Daemon, state: str) -> list[str]:
    return [i["id"] for i in instances(d, all_=True) if i["state"] == state]


def test_run_whose_cgpud_goes_away_exits_with_its_childs_code_at_once(tmp_path, sim_env):
    """The child exits while cgpud is stopped: cgpuctl tries the release
    once, says cgpud will do it, and exits with the child's code without
    waiting out --wait; the cgpud that comes back releases the instance."""
    d = make_daemon(tmp_path, sim_env)
    d.start()
    gate = tmp_path / "go"
    proc = _cgpuctl(
        d.socket, d.env, "run", "--mem", "1GiB", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 3"
    )
    try:
        (instance,) = until(lambda: _ids_in(d, "bound"), 30, interval=0.05, what="the tenant's instance bound")
        d.stop()
        gate.touch()
        started = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - started
        assert proc.returncode == 3, err
        assert took < RELAY_WAIT_S / 2, took
        assert err == (
            f"cgpuctl: cannot reach cgpud at {d.socket}: is it running? (systemctl status cgpud); "
            f"cgpud releases instance {instance} once it is back\n"
        )
        d.start()
        assert until(lambda: _ids_in(d, "released"), 30, interval=0.05) == [instance]
    finally:
        if proc.poll() is None:
            proc.kill()
        d.stop()


def test_cgpud_that_never_comes_back_fails_within_the_bound(tmp_path, sim_env):
    socket = tmp_path / "run" / "cgpud.sock"
    started = time.monotonic()
    proc = _cgpuctl(socket, sim_env, "--wait", "1.5", "create", "--mem", "1GiB")
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - started
    assert proc.returncode == 1
    why = f"cgpud is not running ({socket}: No such file or directory)"
    assert err == (
        f"cgpuctl: {why}; retrying for 1.5 s\n"
        f"cgpuctl: {why}; it did not come back within 1.5 s: start it (systemctl start cgpud)\n"
    )
    assert 1.5 <= took < 6, took


def test_reads_wait_less_and_zero_fails_at_once(tmp_path, sim_env):
    socket = tmp_path / "cgpud.sock"
    started = time.monotonic()
    proc = _cgpuctl(socket, sim_env, "list")
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - started
    assert proc.returncode == 1 and "retrying for 3 s" in err and "within 3 s" in err, err
    assert 3 <= took < 8, took

    proc = _cgpuctl(socket, sim_env, "--wait", "0", "list")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert err == f"cgpuctl: cannot reach cgpud at {socket}: is it running? (systemctl status cgpud)\n"


def test_a_cgpud_busy_for_two_seconds_still_answers(tmp_path, sim_env):
    """cgpud accepted the connection (the kernel does, into the listen
    backlog) but answers nothing for 2 s, as one just started on a loaded
    machine may: cgpuctl waits for it within its call timeout. It failed at
    once with "timed out before receiving SETTINGS frame" while gRPC gave a
    connection attempt only 100 ms."""
    d = make_daemon(tmp_path, sim_env)
    d.start()
    try:
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            proc = _cgpuctl(d.socket, d.env, "--wait", "0", "list", "--output", "json")
            time.sleep(2.0)
            assert proc.poll() is None, proc.communicate()
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out.strip(), err) == (0, "[]", "")
    finally:
        d.stop()
