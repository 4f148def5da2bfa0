"""`cgpuctl sim fault` run in its own process, the way an operator injects a
fault into the simulated GPUs that a running cgpud watches (the injector
shares the simulation's state, not the test's process)."""

from __future__ import annotations

import subprocess
import sys


def inject_fault(env: dict[str, str], *args: str) -> None:
    """`cgpuctl sim fault ARGS` with the simulation `env` names; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "cgpud.cli.main", "sim", "fault", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
