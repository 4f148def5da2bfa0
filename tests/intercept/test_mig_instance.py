"""libcgpu.so inside a MIG instance: a process that sees one MIG device
(CUDA_VISIBLE_DEVICES=MIG-...) under a region naming that MIG device's UUID
is held to the region's limit, through CUDA and NVML alike. The simulated
machine boots GPU 0 in MIG mode (docs/simulated-gpu.md, "MIG")."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from cgpud.node.region import DeviceLimit, InstanceLimits, write_region
from tests.harness.sim import sim_env_in
from tests.harness.simrun import PYNVML, run_py

GIB = 1 << 30
MIB = 1 << 20
INSTANCE_MIB = 20096  # a 2g.20gb instance of an H100 80GB


@pytest.fixture
def mig(tmp_path: Path, native: Path) -> dict[str, str]:
    return sim_env_in(tmp_path / "mig", native, mem="80GiB", placements=["mig=3g.40gb,2g.20gb"])


def mig_uuid(env: dict[str, str], index: int) -> str:
    return run_py(  # type: ignore[no-any-return]
        env,
        PYNVML
        + f"""
n.nvmlInit()
print(json.dumps(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(n.nvmlDeviceGetHandleByIndex(0), {index}))))
""",
    )


def in_region(env: dict[str, str], region: Path, libcgpu: Path, visible: str, limit: int, uuid: str) -> dict[str, str]:
    write_region(region, InstanceLimits(region.name, (DeviceLimit(uuid, limit, 0),)))
    out = dict(env, LD_PRELOAD=str(libcgpu), CGPU_REGION_DIR=str(region), CUDA_VISIBLE_DEVICES=visible)
    out.pop("CGPU_LOG_LEVEL", None)
    return out


TENANT = """
import json
from cudapy import Driver
import pynvml as n
cu = Driver(); cu.init_device(0)
info = [cu.mem_info()]
allocs = [cu.alloc(GIB)[0] for _ in range(4)]
info.append(cu.mem_info())
n.nvmlInit()
h = n.nvmlDeviceGetMigDeviceHandleByIndex(n.nvmlDeviceGetHandleByIndex(0), INDEX)
m = n.nvmlDeviceGetMemoryInfo(h)
print(json.dumps({"info": info, "allocs": allocs, "nvml": [m.total, m.used]}))
"""


def tenant(env: dict[str, str], index: int) -> dict:
    return run_py(env, f"GIB = {GIB}; INDEX = {index}\n" + textwrap.dedent(TENANT))  # type: ignore[no-any-return]


def test_a_limit_inside_a_mig_instance_holds_in_cuda_and_nvml(mig, tmp_path, libcgpu):
    uuid = mig_uuid(mig, 1)
    env = in_region(mig, tmp_path / "r", libcgpu, uuid, 3 * GIB, uuid)
    got = tenant(env, 1)
    assert got["allocs"] == ["CUDA_SUCCESS"] * 3 + ["CUDA_ERROR_OUT_OF_MEMORY"]
    assert got["info"] == [[3 * GIB, 3 * GIB], [0, 3 * GIB]]
    assert got["nvml"] == [3 * GIB, 3 * GIB]


def test_a_region_for_the_parent_gpu_gives_nothing_on_its_mig_device(mig, tmp_path, libcgpu):
    """Identity is the UUID: the MIG device is not its parent GPU, so an
    instance of the parent holds nothing on it (as on any device outside
    the instance)."""
    parent = run_py(
        mig, PYNVML + "n.nvmlInit(); print(json.dumps(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(0))))"
    )
    uuid = mig_uuid(mig, 1)
    env = in_region(mig, tmp_path / "r", libcgpu, uuid, 3 * GIB, parent)
    got = tenant(env, 1)
    assert got["allocs"] == ["CUDA_ERROR_OUT_OF_MEMORY"] * 4
    unlimited = tenant(dict(mig, CUDA_VISIBLE_DEVICES=uuid), 1)  # no libcgpu: the instance's own memory
    assert unlimited["info"][0] == [INSTANCE_MIB * MIB, INSTANCE_MIB * MIB]
    assert unlimited["allocs"] == ["CUDA_SUCCESS"] * 4
