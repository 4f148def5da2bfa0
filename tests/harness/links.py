"""How GPUs are joined, as cgpud reads it (cgpud.node.topology.Link), for
the tests that choose by it: the machine cgpuctl sim --topology nvlink2x2
writes, two NVLink-bridged pairs on two sockets."""

from __future__ import annotations

from cgpud.node.topology import NODE, SYSTEM, Link

# GPUs 0-1 and 2-3 joined by two links each on one socket; across, nothing.
NVLINK_PAIRS = {
    (0, 1): Link(NODE, 2),
    (2, 3): Link(NODE, 2),
    (0, 2): Link(SYSTEM),
    (0, 3): Link(SYSTEM),
    (1, 2): Link(SYSTEM),
    (1, 3): Link(SYSTEM),
}
