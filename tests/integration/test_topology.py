"""Whole-GPU choices by topology, side by side with NVIDIA's go-gpuallocator
(its best-effort policy, built from the Go module proxy:
tests/harness/gpuallocator.py). Both read the same simulated machine
through NVML: DGX-1's hybrid cube-mesh, an 8-GPU NVSwitch HGX, 4 PCIe GPUs
on two sockets, and two NVLink-bridged pairs (cgpud/cli/sim_topology.py). cgpu's side is
`cgpud --inventory` (the links it reads) and cgpud.node.topology.best_set,
what its device plugin's GetPreferredAllocation answers with.

Every request of every size over every set of free GPUs is asked of both.
Where they differ, cgpu's choice must score more in all (how well the set
given is joined, plus the best set of the same size left for the next
request), or as much in all with a better joined set given, or as much by
both: that is the reason for every difference, and the test fails on any
other."""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest

from cgpud.cli.sim_topology import TOPOLOGIES
from cgpud.native import native_path
from cgpud.node.inventory import Gpu, Inventory
from cgpud.node.topology import SINGLE, Link, best_left, best_set, set_score
from tests.harness import gpuallocator
from tests.harness.daemon import BIN


def machine(tmp_path: Path, topology: str) -> dict[str, str]:
    config = tmp_path / f"{topology}.conf"
    config.write_text(
        "".join(f'gpu name="Tesla V100-SXM2-16GB" mem=16GiB sms=80 cc=7.0 {keys}\n' for keys in TOPOLOGIES[topology])
    )
    return {
        "PATH": "/usr/bin:/bin",
        "LD_LIBRARY_PATH": str(native_path("sim/libnvidia-ml.so.1").parent),
        "CGPU_SIM_CONFIG": str(config),
        "CGPU_SIM_STATE": str(tmp_path / f"{topology}.state"),
    }


def cgpu_links(env: dict[str, str]) -> dict[tuple[int, int], Link]:
    out = subprocess.run([str(BIN / "cgpud"), "--inventory"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    gpus = tuple(
        Gpu(
            **{
                **g,
                "compute_capability": tuple(g["compute_capability"]),
                "nvlink_peers": tuple(g["nvlink_peers"]),
                "pcie_levels": tuple(g["pcie_levels"]),
            }
        )
        for g in data["gpus"]
    )
    return Inventory(data["driver_version"], data["cuda_driver_version"], gpus).links()


def left_best(links: dict[tuple[int, int], Link], free: tuple[int, ...], taken: tuple[int, ...], size: int) -> int:
    return best_left(links, [g for g in free if g not in taken], size)


def test_the_simulated_dgx1_reads_as_nvidia_describes_it(tmp_path: Path) -> None:
    links = cgpu_links(machine(tmp_path, "dgx1"))
    assert links[(0, 3)] == Link(30, 2) and links[(0, 1)] == Link(SINGLE, 1) and links[(0, 4)] == Link(50, 2)
    assert links[(0, 5)] == Link(50, 0)  # across sockets, no link
    assert sum(link.nvlinks for (a, b), link in links.items() if 0 in (a, b)) == 6  # six links a V100


def test_the_simulated_hgx_joins_every_pair_through_its_nvswitches(tmp_path: Path) -> None:
    links = cgpu_links(machine(tmp_path, "hgx8"))
    assert links[(0, 1)] == Link(SINGLE, 18) and links[(0, 7)] == Link(50, 18)
    assert {link.nvlinks for link in links.values()} == {18}


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_choices_match_go_gpuallocator_or_are_better_for_a_reason(tmp_path: Path, topology: str) -> None:
    env = machine(tmp_path, topology)
    links = cgpu_links(env)
    n = len(TOPOLOGIES[topology])
    requests = [
        (free, (), size)
        for count in range(1, n + 1)
        for free in itertools.combinations(range(n), count)
        for size in range(1, count)
    ]
    theirs = gpuallocator.choices(env, requests)
    same = better_in_all = better_given = equal = 0
    for (free, _, size), nvidia in zip(requests, theirs, strict=True):
        ours = best_set(links, free, size)
        assert len(nvidia) == size and set(nvidia) <= set(free), (free, size, nvidia)
        if ours == nvidia:
            same += 1
            continue
        all_ours = set_score(links, ours) + left_best(links, free, ours, size)
        all_theirs = set_score(links, nvidia) + left_best(links, free, nvidia, size)
        assert all_ours >= all_theirs, (free, size, ours, nvidia)
        if all_ours > all_theirs:
            better_in_all += 1
            continue
        assert set_score(links, ours) >= set_score(links, nvidia), (free, size, ours, nvidia)
        if set_score(links, ours) > set_score(links, nvidia):
            better_given += 1
        else:
            equal += 1  # as good by both measures: the tie is broken otherwise
    print(
        f"\n{topology}: {len(requests)} requests: same {same}, cgpu better in all {better_in_all}, "
        f"as good in all with a better joined set given {better_given}, as good by both {equal}"
    )
    assert same + better_in_all + better_given + equal == len(requests)
