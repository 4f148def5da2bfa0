"""The GPUs' device nodes in cgpud's CDI spec and whole-GPU answers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cgpud.containers.cdi import device
from cgpud.containers.devices import CONTROL_NODES, DeviceNode, device_paths, gpu_node, present
from cgpud.containers.edits import ContainerEdits
from cgpud.kube.model import ContainerAllocation
from cgpud.kube.plugin import allocation_to_pb


def test_device_paths_are_the_control_nodes_then_each_gpu_once() -> None:
    assert device_paths([gpu_node(1), "", gpu_node(0), gpu_node(1)]) == (*CONTROL_NODES, "/dev/nvidia1", "/dev/nvidia0")


def test_present_keeps_character_devices_with_their_numbers_and_skips_the_rest(tmp_path: Path) -> None:
    char, plain, missing = tmp_path / "nvidia3", tmp_path / "nvidia4", tmp_path / "nvidia5"
    os.mknod(char, stat.S_IFCHR | 0o600, os.makedev(195, 3))  # the tests run as root
    plain.write_text("")
    assert present([str(char), str(plain), str(missing)]) == (DeviceNode(str(char), 195, 3),)


def test_a_cdi_device_carries_its_nodes_and_none_when_there_are_none() -> None:
    nodes = (DeviceNode("/dev/nvidiactl", 195, 255), DeviceNode("/dev/nvidia1", 195, 1))
    edits = ContainerEdits((("A", "1"),), (), (), "cgpu-1", nodes)
    assert device(edits)["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "permissions": "rw"},
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1, "permissions": "rw"},
    ]
    assert "deviceNodes" not in device(ContainerEdits((("A", "1"),), (), (), "cgpu-1"))["containerEdits"]


def test_under_a_dev_root_nodes_are_found_there_and_keep_their_dev_path_in_the_container(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    os.mknod(tmp_path / "dev/nvidia3", stat.S_IFCHR | 0o600, os.makedev(195, 3))
    found = present(["/dev/nvidia3", "/dev/nvidia4"], tmp_path)
    assert found == (DeviceNode("/dev/nvidia3", 195, 3, str(tmp_path / "dev/nvidia3")),)
    assert device(ContainerEdits((), (), (), "cgpu-1", found))["containerEdits"]["deviceNodes"] == [
        {
            "path": "/dev/nvidia3",
            "type": "c",
            "major": 195,
            "minor": 3,
            "permissions": "rw",
            "hostPath": str(tmp_path / "dev/nvidia3"),
        }
    ]


def test_a_whole_gpu_answer_names_its_device_nodes_for_the_kubelet() -> None:
    nodes = (
        DeviceNode("/dev/nvidiactl", 195, 255),
        DeviceNode("/dev/nvidia0", 195, 0, "/run/nvidia/driver/dev/nvidia0"),
    )
    answer = allocation_to_pb(ContainerAllocation(devices=nodes))
    assert [(d.container_path, d.host_path, d.permissions) for d in answer.devices] == [
        ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
        ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0", "rw"),
    ]
