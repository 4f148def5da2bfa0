"""The multi-node harness (tests/harness/cluster.py) leaves nothing on the host:
not when its block fails, and not when its process is killed (the next
run's sweep removes what the killed one left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness.cluster import LINK_PREFIX, NETNS_PREFIX, ROOT_PREFIX, Cluster, sweep_leftovers
from tests.harness.wait import until

pytestmark = pytest.mark.slow  # tens of seconds to minutes each

REPO = Path(__file__).resolve().parents[2]


def traces(tag: str) -> list[str]:
    """What of a run (by its tag) is on the host: namespaces, links, its directory."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    found = [line.split()[0] for line in netns.splitlines() if line.startswith(f"{NETNS_PREFIX}{tag}-")]
    found += [
        f.rstrip(":").split("@")[0]
        for line in links.splitlines()
        for f in line.split()[1:2]
        if f.startswith(f"{LINK_PREFIX}{tag}")
    ]
    found += [str(p) for p in Path("/tmp").glob(f"{ROOT_PREFIX}{tag}-*")]
    return found


def wait_gone(tag: str) -> None:
    """Until no trace of the run is left (the kernel removes a deleted
    namespace's veth pair a moment later)."""
    until(
        lambda: traces(tag) == [],
        timeout=5,
        interval=0.05,
        what=f"no trace left of run {tag}",
        explain=lambda: f"left: {traces(tag)}",
    )


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_failing_block_leaves_no_namespace_link_directory_or_process() -> None:
    cluster = Cluster(nodes=2, tls=False)
    with pytest.raises(RuntimeError, match="the test failed"):
        with cluster:
            assert len(traces(cluster.tag)) == 2 + 2 + 1  # two namespaces, two host links, the directory
            pids = [n.daemon.proc.pid for n in cluster.nodes if n.daemon.proc is not None]
            assert len(pids) == 2 and all(map(running, pids))
            raise RuntimeError("the test failed")
    wait_gone(cluster.tag)
    assert not any(map(running, pids))


def test_the_sweep_removes_what_a_killed_run_left() -> None:
    script = textwrap.dedent("""
        import sys, time
        from tests.harness.cluster import Cluster
        c = Cluster(nodes=1, tls=False).start()
        print(c.tag, c.nodes[0].daemon.proc.pid, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    try:
        assert proc.stdout is not None
        tag, pid = proc.stdout.readline().split()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    left = traces(tag)
    assert len(left) == 1 + 1 + 1 and running(int(pid))  # its namespace, link, directory and cgpud stay behind

    removed = sweep_leftovers()
    assert f"{NETNS_PREFIX}{tag}-0" in removed and any(r.startswith(f"/tmp/{ROOT_PREFIX}{tag}-") for r in removed)
    wait_gone(tag)
    assert not running(int(pid))
