"""Real cgpud processes on simulated GPUs, each serving its Capacity API on
a loopback port under its own node name: the nodes an extender watches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.daemon import BIN, Daemon, make_daemon
from tests.harness.net import free_port
from tests.harness.sim import sim_env_in

__all__ = ["BIN", "Node", "cgpud_nodes"]


@dataclass
class Node:
    name: str
    address: str
    daemon: Daemon


@contextmanager
def cgpud_nodes(tmp_path: Path, native: Path, count: int, *extra: str) -> Iterator[list[Node]]:
    nodes = []
    try:
        for i in range(count):
            dir = tmp_path / f"node-{i}"
            port = free_port()
            d = make_daemon(
                dir,
                sim_env_in(dir, native),
                "--capacity-listen",
                f"127.0.0.1:{port}",
                "--node-name",
                f"node-{i}",
                *extra,
            )
            d.start()
            nodes.append(Node(f"node-{i}", f"127.0.0.1:{port}", d))
        yield nodes
    finally:
        for n in nodes:
            if n.daemon.proc is not None and n.daemon.proc.poll() is None:
                n.daemon.stop()
