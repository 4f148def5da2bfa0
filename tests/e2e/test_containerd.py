"""GPU containers through a real, throwaway containerd (own root, state and
socket), with cgpu-runtime registered by `cgpuctl runtime configure`.

`ctr run` is not a CRI client, so containerd's CRI runtime table does not
apply to it; the test reads the BinaryName containerd itself loaded from
the drop-in (`containerd config dump`) and hands it to ctr."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cgpud.node.model import GIB
from cgpud.native import native_path
from tests.harness.daemon import Daemon
from tests.harness.oci import Host
from tests.harness.containerd import Containerd, ctr_run_on_sim, loaded_binary_name
from tests.harness.workload import BURN, burn_json, env_lines, instances


def ctr_run(
    c: Containerd, host: Host, tmp: Path, binary: str, env: tuple[str, ...], *cmd: str
) -> subprocess.CompletedProcess[str]:
    """A `ctr run --rm` of a fresh copy of the template under tmp."""
    return ctr_run_on_sim(c, host, tmp / f"rootfs-{host.new_id()}", binary, env, host.new_id(), *cmd)


def test_runtime_configure_registers_the_shim_containerd_loads(containerd: Containerd) -> None:
    assert loaded_binary_name(containerd.config) == str(native_path("bin/cgpu-runtime"))


def test_2gib_container_through_containerd(tmp_path, host: Host, cgpud: Daemon, containerd: Containerd) -> None:
    binary = loaded_binary_name(containerd.config)
    out = ctr_run(containerd, host, tmp_path, binary, ("ALIYUN_COM_GPU_MEM_CONTAINER=2",), "sh", "-c", f"env; {BURN}")
    assert out.returncode == 0, out.stderr + containerd.log.read_text()[-2000:]
    burn = burn_json(out.stdout)
    assert burn["mem_total_reported"] == 2 * GIB
    assert burn["alloc"]["until_fail_bytes"] == 2 * GIB
    assert burn["alloc"]["until_fail_result"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert env_lines(out.stdout)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
    assert instances(cgpud) == []
    assert [i["state"] for i in instances(cgpud, all_=True)] == ["released"]


def test_refusal_reaches_the_ctr_user(tmp_path, host: Host, cgpud: Daemon, containerd: Containerd) -> None:
    binary = loaded_binary_name(containerd.config)
    out = ctr_run(containerd, host, tmp_path, binary, ("ALIYUN_COM_GPU_MEM_CONTAINER=17",), "true")
    assert out.returncode != 0
    assert "asked for 17 GiB per GPU but the largest GPU on this node has 16 GiB" in out.stderr, out.stderr
    assert instances(cgpud, all_=True) == []


def test_non_gpu_container_through_containerd(tmp_path, host: Host, cgpud: Daemon, containerd: Containerd) -> None:
    binary = loaded_binary_name(containerd.config)
    out = ctr_run(containerd, host, tmp_path, binary, (), "echo", "plain")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "plain"
    assert instances(cgpud, all_=True) == []
