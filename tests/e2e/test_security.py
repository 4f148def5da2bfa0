"""What a hostile image or tenant can do to the container start path: each
test is a real runc container through cgpu-runtime and cgpu-hook."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from tests.harness.daemon import Daemon
from tests.harness.oci import Host, plant_symlink, run, settled, shim_container, steady_mounts
from tests.harness.preload_poc import build_poc
from tests.harness.workload import BURN, assert_no_breakout, breakout_script, burn_json, instances


def test_image_ld_preload_from_cwd_never_runs_on_the_host(tmp_path, host: Host, cgpud: Daemon) -> None:
    """The NVIDIAScape pattern: an image's LD_PRELOAD that resolves, through
    a hook's working directory, to a library in the rootfs."""
    marker = Path("/tmp") / f"cgpu-poc-{uuid.uuid4().hex}"
    b = host.bundle(
        tmp_path / "b",
        ["sh", "-c", "cgpu-burn --help >/dev/null; ls /tmp"],
        ("ALIYUN_COM_GPU_MEM_CONTAINER=1", "LD_PRELOAD=/proc/self/cwd/poc.so"),
    )
    (b.rootfs / "poc.so").write_bytes(build_poc(tmp_path, marker).read_bytes())
    b.spec["process"]["cwd"] = "/"
    b.write()
    try:
        out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
        assert out.returncode == 0, out.stderr
        # It did run inside the container (the marker is in the rootfs's /tmp)...
        assert marker.name in out.stdout
        # ...and nowhere on the host.
        assert not marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def _symlinked(
    host: Host, tmp_path: Path, name: str, link: str, target: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    b = host.bundle(
        tmp_path / name, ["sh", "-c", f"cat /etc/ld.so.preload; {BURN}"], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",)
    )
    return b, plant_symlink(b.rootfs, link, target)


@pytest.mark.parametrize(
    ("link", "escape"),
    [
        ("/etc", "/../../../{out}"),
        ("/usr/local", "/../../../{out}"),
        ("/run", "/../../../{out}"),
        ("/etc/ld.so.preload", "/../../../{out}/preload"),
        ("/etc/ld.so.preload", "/proc/sys/kernel/core_pattern"),
        ("/run", "/proc/self/cwd"),
    ],
)
def test_symlinks_in_the_rootfs_never_lead_outside_it(
    tmp_path, host: Host, cgpud: Daemon, mounts, link: str, escape: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    mounts_before = steady_mounts(mounts)
    b, _ = _symlinked(host, tmp_path, "b", link, escape.format(out=outside))
    out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
    # Either it started with its limit or it failed saying why.
    if out.returncode == 0:
        assert out.stdout.splitlines()[0] == "/usr/local/cgpu/libcgpu.so"
        assert burn_json(out.stdout)["alloc"]["until_fail_bytes"] == 2 * GIB
    else:
        assert f"the image makes {link} a symbolic link" in out.stderr
    assert list(outside.iterdir()) == []
    assert Path("/proc/sys/kernel/core_pattern").read_text() == core_pattern
    assert settled(mounts, mounts_before) == mounts_before
    assert instances(cgpud) == []


def test_mount_table_unchanged_after_20_container_cycles(tmp_path, host: Host, cgpud: Daemon, mounts) -> None:
    before = steady_mounts(mounts)
    for i in range(20):
        b = host.bundle(tmp_path / f"b{i}", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
        out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
        assert out.returncode == 0, out.stderr
    assert settled(mounts, before) == before
    assert instances(cgpud) == []
    assert len(instances(cgpud, all_=True)) == 20


def test_a_container_cannot_write_its_limits_or_reach_other_instances(tmp_path, host: Host, cgpud: Daemon) -> None:
    neighbour = host.bundle(tmp_path / "n", ["sleep", "60"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
    nid = host.new_id()
    with shim_container(host, neighbour, nid, cgpud.relay, start=False):
        [other] = instances(cgpud)
        other_region = cgpud.state / "instances" / other["id"]
        other_limits = (other_region / "limits").read_bytes()
        script = breakout_script(other_region)
        for user in (0, 1000):
            b = host.bundle(tmp_path / f"t{user}", ["sh", "-c", script], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
            b.spec["process"]["user"] = {"uid": user, "gid": user}
            b.write()
            out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
            assert out.returncode == 0, out.stderr
            assert_no_breakout(out.stdout, str(user))
        assert (other_region / "limits").read_bytes() == other_limits
    assert instances(cgpud) == []
