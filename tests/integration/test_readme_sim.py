"""README.md's `sim` blocks, run by bash as they stand from the clone's
root (issue 41). The block names /tmp/cgpu: it is a tmpfs in a mount
namespace of the block's own here, so a run leaves nothing on the machine
(cgpud's instance mounts go with the namespace) and meets no earlier run."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.harness.readme import Block, readme_blocks

REPO = Path(__file__).resolve().parents[2]
PRIVATE_TMP = 'mkdir -p /tmp/cgpu && mount -t tmpfs -o mode=0700 readme-sim /tmp/cgpu && exec bash -e -c "$0"'


@pytest.mark.parametrize("block", readme_blocks("sim"), ids=lambda b: b.where)
def test_the_readmes_simulated_gpu_block_runs(block: Block, record_property: pytest.RecordProperty) -> None:
    record_property("readme_block", block.where)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CGPU_", "LD_"))}
    proc = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", PRIVATE_TMP, block.text],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        try:  # whatever the block left running in the background
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:  # the mount point the namespace's tmpfs was on
            Path("/tmp/cgpu").rmdir()
        except OSError:
            pass
    assert proc.returncode == 0, f"{block.where} failed:\n{block.text}\n{out[-3000:]}\n{err[-3000:]}"
    # What the README says of it: four 1 GiB allocations under 4 GiB, and the inspect table.
    assert '"until_fail_count":4' in out.replace(" ", ""), out[-3000:]
    assert "Allocated/Total GPU Memory In Cluster:" in out, out[-3000:]
