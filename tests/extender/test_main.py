"""cgpu-scheduler's command line, as a process: options it refuses before it
serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CGPU_SCHEDULER = Path(sys.executable).parent / "cgpu-scheduler"


def test_pick_at_filter_without_client_ca_is_refused_with_the_reason(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes"
    nodes.write_text("gpu-1 127.0.0.1:9455\n")
    done = subprocess.run(
        [str(CGPU_SCHEDULER), "--listen", "127.0.0.1:0", "--nodes", str(nodes), "--pick-at-filter"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "cgpu-scheduler: --pick-at-filter needs --client-ca" in done.stderr, done
    assert "listening" not in done.stderr
