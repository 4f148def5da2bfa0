"""MIG under NVIDIA's strategies: the inventory of a simulated MIG machine
(read through NVML), which MIG devices each strategy serves under which
resource, the labels GPU feature discovery would write, the device lists,
and placement refusing to share a GPU in MIG mode."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cgpud.errors import UsageError
from cgpud.kube.mig import MigStrategy, gfd_labels, parse_strategy, plan
from cgpud.kube.mig_devices import capability_nodes, capability_paths, parse_mig_minors
from cgpud.kube.resources import PluginGpu, advertised
from cgpud.node.inventory import Gpu, Inventory
from cgpud.node.inventory import capacities as node_capacities
from cgpud.node.mig import mig_profile_name
from cgpud.node.model import GIB, GpuCapacity, NodeMode, NodePolicy, Request, Owner, OwnerKind
from cgpud.node.placement import admit, gpu_usage
from tests.harness.sim import read_sim_inventory, sim_env_in

MIB = 1 << 20


@pytest.fixture(scope="module")
def mixed_machine(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Inventory:
    """GPU 0: 3g.40gb, 2g.20gb, 1g.10gb; GPU 1 whole."""
    env = sim_env_in(tmp_path_factory.mktemp("mixed"), native, mem="80GiB", placements=["mig=3g.40gb,2g.20gb,1g.10gb"])
    return read_sim_inventory(env)


@pytest.fixture(scope="module")
def uniform_machine(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Inventory:
    """Both GPUs: 2 x 3g.40gb."""
    env = sim_env_in(tmp_path_factory.mktemp("uniform"), native, mem="80GiB", placements=["mig=3g.40gb,3g.40gb"] * 2)
    return read_sim_inventory(env)


def test_the_inventory_reads_mig_mode_and_each_mig_device(mixed_machine):
    gpu0, gpu1 = mixed_machine.gpus
    assert (gpu0.mig_mode, gpu1.mig_mode, gpu1.mig_devices) == (True, False, ())
    got = [
        (m.profile, m.memory_total // MIB, m.sm_count, m.gpu_instance, m.compute_instance, m.parent_index)
        for m in gpu0.mig_devices
    ]
    assert got == [("3g.40gb", 40448, 60, 1, 0, 0), ("2g.20gb", 20096, 32, 5, 0, 0), ("1g.10gb", 9984, 16, 13, 0, 0)]
    assert all(m.uuid.startswith("MIG-") for m in gpu0.mig_devices)


@pytest.mark.parametrize(
    ("gi", "ci", "mib", "gpu", "name"),
    [
        (1, 1, 9984, 80 * GIB, "1g.10gb"),  # H100 80GB
        (7, 7, 81152, 80 * GIB, "7g.80gb"),
        (1, 1, 4864, 40 * GIB, "1g.5gb"),  # A100 40GB
        (3, 3, 20096, 40 * GIB, "3g.20gb"),
        (3, 1, 40448, 80 * GIB, "1c.3g.40gb"),
    ],
)
def test_profile_names_as_nvidia_makes_them(gi, ci, mib, gpu, name):
    assert mig_profile_name(gi, ci, mib, gpu) == name


def test_mixed_serves_each_mig_device_under_its_profile(mixed_machine):
    p = plan(MigStrategy.MIXED, mixed_machine.gpus)
    assert p.problem == "" and p.hidden == (0,)
    assert [(s.resource, s.device.profile) for s in p.served] == [
        ("nvidia.com/mig-3g.40gb", "3g.40gb"),
        ("nvidia.com/mig-2g.20gb", "2g.20gb"),
        ("nvidia.com/mig-1g.10gb", "1g.10gb"),
    ]
    assert p.resources() == ("nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb")


def test_single_serves_alike_mig_devices_as_nvidia_gpu(uniform_machine):
    p = plan(MigStrategy.SINGLE, uniform_machine.gpus)
    assert p.problem == "" and len(p.served) == 4
    assert {s.resource for s in p.served} == {"nvidia.com/gpu"} and p.resources() == ()


def test_single_refuses_a_node_it_cannot_serve_and_says_why(mixed_machine, uniform_machine):
    mixed = plan(MigStrategy.SINGLE, mixed_machine.gpus)
    assert mixed.served == () and "devices with MIG enabled and disabled" in mixed.problem
    only_gpu0 = (mixed_machine.gpus[0],)
    assert plan(MigStrategy.SINGLE, only_gpu0).problem.startswith("more than one MIG device type present on node")
    empty = (replace(uniform_machine.gpus[0], mig_devices=()),)
    assert plan(MigStrategy.SINGLE, empty).problem == "no MIG devices present on node"
    none = plan(MigStrategy.NONE, mixed_machine.gpus)
    assert none.served == () and none.hidden == (0,) and "mig_strategy none serves no MIG device" in none.problem


def test_a_strategy_name_nvidia_does_not_have_is_refused():
    assert parse_strategy(" mixed ") is MigStrategy.MIXED
    with pytest.raises(UsageError, match="unknown mig_strategy 'Mixed': use none, single or mixed"):
        parse_strategy("Mixed")


def test_mixed_labels_as_gpu_feature_discovery(mixed_machine):
    labels = gfd_labels(MigStrategy.MIXED, mixed_machine.gpus, mig_capable=True)
    assert labels["nvidia.com/mig.capable"] == "true"
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert {k: v for k, v in labels.items() if k.startswith("nvidia.com/mig-1g.10gb.")} == {
        "nvidia.com/mig-1g.10gb.count": "1",
        "nvidia.com/mig-1g.10gb.memory": "9984",
        "nvidia.com/mig-1g.10gb.multiprocessors": "16",
        "nvidia.com/mig-1g.10gb.slices.gi": "1",
        "nvidia.com/mig-1g.10gb.slices.ci": "1",
        "nvidia.com/mig-1g.10gb.engines.copy": "1",
        "nvidia.com/mig-1g.10gb.engines.decoder": "1",
        "nvidia.com/mig-1g.10gb.engines.encoder": "0",
        "nvidia.com/mig-1g.10gb.engines.jpeg": "1",
        "nvidia.com/mig-1g.10gb.engines.ofa": "0",
    }
    assert labels["nvidia.com/mig-3g.40gb.count"] == "1" and labels["nvidia.com/mig-3g.40gb.multiprocessors"] == "60"
    assert "nvidia.com/gpu.product" not in labels


def test_single_labels_override_the_gpu_product_count_and_memory(uniform_machine, mixed_machine):
    labels = gfd_labels(MigStrategy.SINGLE, uniform_machine.gpus, mig_capable=True)
    assert labels["nvidia.com/mig.strategy"] == "single"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb"
    assert (labels["nvidia.com/gpu.count"], labels["nvidia.com/gpu.memory"]) == ("4", "40448")
    assert (labels["nvidia.com/gpu.multiprocessors"], labels["nvidia.com/gpu.slices.gi"]) == ("60", "3")
    invalid = gfd_labels(MigStrategy.SINGLE, mixed_machine.gpus, mig_capable=True)
    assert invalid["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-INVALID"
    assert (invalid["nvidia.com/gpu.count"], invalid["nvidia.com/gpu.memory"]) == ("0", "0")
    assert "nvidia.com/gpu.multiprocessors" not in invalid  # as GPU feature discovery's own tests have it


def test_no_mig_labels_but_capable_and_strategy_on_a_node_without_mig(mixed_machine):
    whole = (mixed_machine.gpus[1],)
    assert gfd_labels(MigStrategy.SINGLE, whole, mig_capable=True) == {
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "single",
    }


def plugin_gpus(gpus: tuple[Gpu, ...], unhealthy: int | None = None) -> list[PluginGpu]:
    return [PluginGpu(g.index, g.uuid, g.memory_total, g.index != unhealthy) for g in gpus]


def test_device_lists_by_strategy_and_mode(mixed_machine, uniform_machine):
    gpus = mixed_machine.gpus
    migs = [m.uuid for m in gpus[0].mig_devices]
    mixed = advertised(NodeMode.DEFAULT, plugin_gpus(gpus), plan(MigStrategy.MIXED, gpus))
    # The GPU in MIG mode is no nvidia.com/gpu; its MIG devices are their profiles'.
    assert [d.id for d in mixed["nvidia.com/gpu"]] == [gpus[1].uuid]
    assert [d.id for d in mixed["nvidia.com/mig-2g.20gb"]] == [migs[1]]
    # A sharing node: the GPU in MIG mode makes no aliyun.com/gpu-mem device, its MIG devices stay served.
    cgpu = advertised(NodeMode.CGPU, plugin_gpus(gpus, unhealthy=0), plan(MigStrategy.MIXED, gpus))
    assert {d.id.rpartition("-_-")[0] for d in cgpu["aliyun.com/gpu-mem"]} == {gpus[1].uuid}
    assert len(cgpu["aliyun.com/gpu-mem"]) == 80
    assert [(d.id, d.healthy) for d in cgpu["nvidia.com/mig-1g.10gb"]] == [(migs[2], False)]  # its GPU's health
    single = advertised(
        NodeMode.DEFAULT, plugin_gpus(uniform_machine.gpus), plan(MigStrategy.SINGLE, uniform_machine.gpus)
    )
    assert [d.id for d in single["nvidia.com/gpu"]] == [m.uuid for g in uniform_machine.gpus for m in g.mig_devices]
    topology = advertised("topology", plugin_gpus(gpus), plan(MigStrategy.MIXED, gpus))
    assert [d.id for d in topology["aliyun.com/gpu"]] == [gpus[1].uuid]
    # none: neither the GPU in MIG mode nor its MIG devices.
    none = advertised(NodeMode.DEFAULT, plugin_gpus(gpus), plan(MigStrategy.NONE, gpus))
    assert [d.id for d in none["nvidia.com/gpu"]] == [gpus[1].uuid]
    assert not any(k.startswith("nvidia.com/mig-") for k in none)


def capacities(inv: Inventory) -> tuple[GpuCapacity, ...]:
    return tuple(GpuCapacity(g.index, g.uuid, g.memory_total, mig=g.mig_mode) for g in inv.gpus)


def share(gib: int, gpus: tuple[int, ...] = ()) -> Request:
    return Request(Owner(OwnerKind.CONTAINER, "c1"), gib * GIB, 1, gpu_indexes=gpus)


def test_sharing_never_lands_on_a_gpu_in_mig_mode(mixed_machine):
    gpus = capacities(mixed_machine)
    policy = NodePolicy(mode=NodeMode.CGPU)
    [grant] = admit(share(4), gpus, [], policy)
    assert grant.gpu_index == 1  # GPU 0 is emptier by instances, but in MIG mode
    usage = gpu_usage(gpus, [])
    assert (usage[0].allocated, usage[0].instances) == (gpus[0].memory, 1)  # shown full in the Capacity view
    with pytest.raises(UsageError, match=r"asked for GPU 0, which is in MIG mode: cgpu does not share"):
        admit(share(4, (0,)), gpus, [], policy)
    whole = NodePolicy(mode=NodeMode.DEFAULT)
    assert [g.gpu_index for g in admit(share(0), gpus, [], whole)] == [1]


def test_a_node_whose_gpus_are_all_in_mig_mode_refuses_shares_with_what_to_ask_for(uniform_machine):
    with pytest.raises(UsageError, match=r"every GPU of this node is in MIG mode.*nvidia.com/mig-<profile>"):
        admit(share(4), capacities(uniform_machine), [], NodePolicy(mode=NodeMode.CGPU))


MIG_MINORS = """config 1
monitor 2
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu0/gi13/access 84
gpu0/gi13/ci0/access 85
gpu1/gi1/access 147
bogus line
"""


def test_a_mig_devices_capability_nodes_from_the_drivers_minors(mixed_machine, tmp_path):
    three_g, _, one_g = mixed_machine.gpus[0].mig_devices  # GPU instances 1 and 13 of GPU 0 (minor 0)
    minors = parse_mig_minors(MIG_MINORS)
    assert minors["gpu0/gi13/ci0/access"] == 85 and "bogus" not in " ".join(minors)
    assert capability_paths([one_g, three_g], {0: 0}, minors) == [
        "/dev/nvidia-caps/nvidia-cap84",
        "/dev/nvidia-caps/nvidia-cap85",
        "/dev/nvidia-caps/nvidia-cap12",
        "/dev/nvidia-caps/nvidia-cap13",
    ]
    assert capability_paths([one_g], {0: 1}, minors) == []  # GPU 0 is /dev/nvidia1: gpu1/gi13 is not listed
    # A host whose driver lists none (the simulated GPUs): no node is named.
    assert capability_nodes([one_g], {0: 0}, tmp_path, tmp_path / "mig-minors") == ()
    (tmp_path / "mig-minors").write_text(MIG_MINORS)
    assert capability_nodes([one_g], {0: 0}, tmp_path, tmp_path / "mig-minors") == ()  # nodes absent under the root


def test_with_mig_share_each_mig_device_is_one_more_gpu(mixed_machine):
    nodes = {mixed_machine.gpus[0].mig_devices[2].uuid: ("/dev/nvidia-caps/nvidia-cap84",)}
    got = node_capacities(mixed_machine, lambda minor: f"/dev/nvidia{minor}", mig_share=True, mig_nodes=nodes)
    assert [(g.index, g.memory // MIB, g.mig, g.parent, g.device_node, g.extra_nodes) for g in got] == [
        (0, 81920, True, -1, "/dev/nvidia0", ()),
        (1, 81920, False, -1, "/dev/nvidia1", ()),
        (2, 40448, False, 0, "/dev/nvidia0", ()),
        (3, 20096, False, 0, "/dev/nvidia0", ()),
        (4, 9984, False, 0, "/dev/nvidia0", ("/dev/nvidia-caps/nvidia-cap84",)),
    ]
    assert [g.uuid for g in got[2:]] == [m.uuid for m in mixed_machine.gpus[0].mig_devices]
    assert len(node_capacities(mixed_machine, lambda minor: "", mig_share=False)) == 2
    # Shared, the MIG devices are served as the mode serves GPUs, and by no strategy.
    shared = plan(MigStrategy.MIXED, mixed_machine.gpus, shared=True)
    assert shared.served == () and shared.hidden == (0,) and shared.problem == ""
    assert gfd_labels(MigStrategy.MIXED, mixed_machine.gpus, True, shared=True) == {
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "mixed",
    }
