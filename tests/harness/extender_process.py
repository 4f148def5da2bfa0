"""cgpu-scheduler (the extender) as its own process on a free loopback
port, for the tests that start it by hand rather than through a cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.harness.cgpud_nodes import BIN
from tests.harness.net import free_port


@contextmanager
def extender_process(log: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """(process, port) of cgpu-scheduler run with `args`, its output in
    `log`; killed when the block ends unless it has already exited (a
    test that stops it with SIGTERM checks that itself)."""
    port = free_port()
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [str(BIN / "cgpu-scheduler"), "--listen", f"127.0.0.1:{port}", *args], stdout=out, stderr=out
        )
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
