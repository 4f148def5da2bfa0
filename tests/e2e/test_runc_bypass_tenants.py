"""The bypass tenants of tests/harness/bypass_build.py in real runc containers made
through cgpu-runtime with a 1 GiB grant: /etc/ld.so.preload is mounted in
each, and each still holds 4 GiB of the GPU. ELF walk: libcgpu is loaded and
never asked. Static (the simulated driver inside): no loader reads the
preload file. musl: its loader never reads /etc/ld.so.preload.

What tests/e2e/test_runc_bypass.py shows the watchdog finding; here only the
escape, beside a dlsym tenant (cgpu-burn) held to 1 GiB in the same kind of
container. The GPU is read through the simulator (cgpu-sim-stat)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import bypass_build
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.oci import Bundle, Host, runc, shim_container
from tests.harness.simrun import sim_stat
from tests.harness.wait import until

GIB = 1 << 30
GPU_MEM = 16 * GIB
TENANT = "/usr/bin/cgpu-bypass"
ALLOC = ["--alloc-mib", "1024", "--count", "4"]
GRANT = ("ALIYUN_COM_GPU_MEM_CONTAINER=1",)


@pytest.fixture
def cgpud(tmp_path: Path, gpu_env: dict[str, str]) -> Iterator[Daemon]:
    """The e2e conftest's cgpud with its watchdog off: what libcgpu alone
    lets through."""
    with running_daemon(tmp_path, gpu_env, "--bypass-interval", "0") as d:
        yield d


def bundle(host: Host, where: Path, kind: str) -> Bundle:
    if kind == "musl":
        b = host.bundle(
            where,
            [bypass_build.MUSL_TENANT, "--resolve", "link", *ALLOC, "--hold", "60"],
            (*GRANT, *bypass_build.MUSL_ENV),
        )
        bypass_build.musl_rootfs(b.rootfs)
        return b
    b = host.bundle(where, [TENANT, "--resolve", "elf" if kind == "elf" else "link", *ALLOC, "--hold", "60"], GRANT)
    tool = bypass_build.elf_bypass() if kind == "elf" else bypass_build.static_bypass()
    (b.rootfs / TENANT.lstrip("/")).unlink(missing_ok=True)  # hard-linked to the template: replace, never write
    shutil.copy2(tool, b.rootfs / TENANT.lstrip("/"))
    return b


def lines(b: Bundle) -> list[dict[str, Any]]:
    """The JSON lines the container has written whole."""
    done = (b.path / "stdio.log").read_text().split("\n")[:-1]
    return [json.loads(x) for x in done if x.startswith("{")]


def wait_line(b: Bundle, event: str, timeout: float = 30) -> dict[str, Any]:
    found = until(
        lambda: [o for o in lines(b) if o.get("event") == event],
        timeout=timeout,
        interval=0.02,
        what=f"{event!r} from the container",
        explain=lambda: (b.path / "stdio.log").read_text()[-2000:],
    )
    return found[0]


@pytest.mark.parametrize("kind", ["elf", "static", "musl"])
def test_bypass_tenant_holds_4gib_in_a_1gib_container(
    tmp_path: Path, host: Host, cgpud: Daemon, native: Path, kind: str
) -> None:
    b = bundle(host, tmp_path / "b", kind)
    cid = host.new_id("bypass")
    with shim_container(host, b, cid, cgpud.relay):
        ready = wait_line(b, "ready")
        held = wait_line(b, "holding")
        pid = json.loads(runc(host, "state", cid).stdout)["pid"]
        listed = json.loads(cgpud.cgpuctl("list", "--output", "json").stdout)
        [inst] = [i for i in listed if pid in i["pids"]]
        [grant] = inst["grants"]
        assert grant["memory_bytes"] == GIB
        # The injection is in place, and not what the tenant goes through.
        assert Path(f"/proc/{pid}/root/etc/ld.so.preload").read_text().strip() == "/usr/local/cgpu/libcgpu.so"
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert ("libcgpu.so" in maps) == (kind == "elf"), maps
        assert ready["mem_total"] == GPU_MEM
        assert held["total_bytes"] == 4 * GIB
        assert [o["total_bytes"] for o in lines(b) if o["event"] == "allocated"] == [GIB * k for k in (1, 2, 3, 4)]
        assert sim_stat(native, host.sim_env)["gpus"][grant["gpu"]]["used"] == 4 * GIB
        assert runc(host, "kill", cid, "TERM", shim=True, relay=cgpud.relay).returncode == 0
        summary = wait_line(b, "summary")
        assert summary["allocated"] == 4 and summary["refused"] is None and summary["errors"] == 0
    assert sim_stat(native, host.sim_env)["gpus"][grant["gpu"]]["used"] == 0


def test_dlsym_tenant_is_held_to_its_1gib_container(tmp_path: Path, host: Host, cgpud: Daemon) -> None:
    """The control: the same container, a tenant that asks the driver by name."""
    b = host.bundle(
        tmp_path / "b",
        ["/usr/bin/cgpu-burn", "--resolve", "dlsym", *[a for _ in range(4) for a in ("--alloc", "1GiB")]],
        GRANT,
    )
    cid = host.new_id("bypass-control")
    with shim_container(host, b, cid, cgpud.relay):
        until(
            lambda: lines(b),
            timeout=30,
            interval=0.02,
            what="the container's report",
            explain=lambda: (b.path / "stdio.log").read_text()[-2000:],
        )
    [report] = lines(b)
    assert report["alloc"]["results"] == ["CUDA_SUCCESS"] + ["CUDA_ERROR_OUT_OF_MEMORY"] * 3
    assert report["mem_total_reported"] == GIB
