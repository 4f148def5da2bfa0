"""pid_alive against real processes, including one cgpud is denied a look at."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.service import pid_alive

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_live_process_recorded_after_its_start_is_alive(sleeper: subprocess.Popen[bytes]) -> None:
    assert pid_alive(sleeper.pid, time.time())


def test_reused_pid_is_dead(sleeper: subprocess.Popen[bytes]) -> None:
    # Recorded an hour before this process started: another process had the PID.
    assert not pid_alive(sleeper.pid, time.time() - 3600)


def test_exited_process_is_dead() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not pid_alive(proc.pid, time.time())


def test_process_that_cannot_be_inspected_is_alive(sleeper: subprocess.Popen[bytes]) -> None:
    # /proc mounted hidepid=1 (noaccess) in a private mount namespace, read by
    # an unprivileged user: psutil raises AccessDenied for the live process.
    probe = textwrap.dedent(f"""
        import os, time, psutil
        from cgpud.node.service import pid_alive
        os.setgroups([]); os.setresgid({NOBODY}, {NOBODY}, {NOBODY}); os.setresuid({NOBODY}, {NOBODY}, {NOBODY})
        try:
            psutil.Process({sleeper.pid}).create_time()
            print("readable")
        except psutil.AccessDenied:
            print("denied")
        print(pid_alive({sleeper.pid}, time.time()))
    """)
    script = f'mount -t proc -o hidepid=1 proc /proc && exec "{sys.executable}" -c "$0"'
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.split() == ["denied", "True"], out.stderr
