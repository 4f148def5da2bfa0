"""The packages in a real older distribution: Debian 11 "bullseye" (glibc
2.31, dpkg 1.20, runc 1.0), debootstrapped once and cached; each test works
in a private overlay of it (tests/harness/older_root.py).

- The deb installs with bullseye's own dpkg; the installed cgpud starts with
  the package's configuration, `cgpuctl run` holds 1 GiB on the simulated
  GPU and `cgpuctl doctor` passes.
- The rpm's payload, installed with rpm --root into a fresh overlay of the
  same root (its Requires checked by hand against the root), does the same.
- A container started through the root's cgpu-runtime with the root's runc
  gets its limit."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from tests.harness.older_root import OlderRoot, older_root
from tests.harness.oci import build_rootfs
from tests.harness.sim import write_sim_config
from tests.packaging.conftest import NEW, Packages

pytestmark = pytest.mark.slow

SOCKET = "/run/cgpud/cgpud.sock"


def sim_environment(root: OlderRoot) -> dict[str, str]:
    """The simulated machine, kept inside the root, and the package's own
    driver and tools as `cgpuctl sim env` names them."""
    root.host_path("/sim").mkdir()
    write_sim_config(root.host_path("/sim/sim.conf"))
    env = root.environment(CGPU_SIM_CONFIG="/sim/sim.conf", CGPU_SIM_STATE="/sim/sim.state")
    out = root.run("cgpuctl", "sim", "env", env=env)
    assert out.returncode == 0, out.stderr
    exported = dict(re.findall(r'^export (\w+)="([^"]*)"', out.stdout, re.M))
    env["LD_LIBRARY_PATH"] = exported["LD_LIBRARY_PATH"].split("${")[0]
    env["PATH"] = exported["PATH"].replace("$PATH", env["PATH"])
    assert env["LD_LIBRARY_PATH"].startswith(f"/opt/cgpu/{NEW}/")
    return env


@contextmanager
def installed_cgpud(root: OlderRoot, env: dict[str, str]) -> Iterator[Path]:
    """/usr/bin/cgpud as installed, with the package's configuration."""
    log = root.host_path("/tmp/cgpud.log")
    with open(log, "w") as out:
        daemon = subprocess.Popen(root.command(["/usr/bin/cgpud"]), env=env, stdout=subprocess.DEVNULL, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while not root.host_path(SOCKET).exists():
            assert daemon.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "cgpud made no socket in 60 s: " + log.read_text()[-3000:]
            time.sleep(0.1)
        yield log
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0, log.read_text()[-3000:]


def holds_one_gib(root: OlderRoot, env: dict[str, str], log: Path) -> None:
    out = root.run("cgpuctl", "run", "--mem", "1", "--", "cgpu-burn", "--alloc-until-fail", "256MiB", env=env)
    assert out.returncode == 0, out.stderr + log.read_text()[-3000:]
    burn = json.loads(out.stdout)
    assert burn["mem_total_reported"] == 1 * GIB and burn["alloc"]["until_fail_count"] == 4


def doctor_passes(root: OlderRoot, env: dict[str, str]) -> str:
    out = root.run("cgpuctl", "doctor", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_deb_installs_and_holds_a_limit_on_debian_11(packages: Packages, tmp_path: Path) -> None:
    with older_root(tmp_path) as root:
        assert root.run("ldd", "--version").stdout.splitlines()[0].endswith("2.31")
        deb = root.copy_in(packages.new_deb, "/tmp/cgpu.deb")
        out = root.run("dpkg", "-i", deb)
        assert out.returncode == 0, out.stdout + out.stderr
        assert root.run("cgpuctl", "--version").stdout.strip() == f"cgpuctl {NEW}"
        env = sim_environment(root)
        with installed_cgpud(root, env) as log:
            holds_one_gib(root, env, log)
            report = doctor_passes(root, env)
        assert "libcgpu.so" in report


def rpm_requires_met(root: OlderRoot, rpm: Path) -> None:
    """rpm --root has no rpm database of the Debian root's packages: the
    rpm's Requires are checked against the root's files by hand."""
    requires = subprocess.run(["rpm", "-qp", "--requires", str(rpm)], capture_output=True, text=True).stdout
    libs = {"glibc": "libc.so.6", "libstdc++": "libstdc++.so.6", "libgcc": "libgcc_s.so.1"}
    checked = set()
    for line in requires.splitlines():
        if line.startswith(("rpmlib(", "/")):
            continue
        name, _, floor = line.partition(" >= ")
        assert name in libs, f"the rpm requires {line}, which this test does not know how to check"
        found = root.run("sh", "-c", f"ls /lib/x86_64-linux-gnu/{libs[name]} /usr/lib/x86_64-linux-gnu/{libs[name]}")
        assert found.stdout.strip(), f"{libs[name]} ({name}) is not in the root"
        if name == "glibc":
            have = root.run("ldd", "--version").stdout.splitlines()[0].split()[-1]
            assert tuple(map(int, have.split("."))) >= tuple(map(int, floor.split("."))), (have, floor)
        checked.add(name)
    assert "glibc" in checked


def test_the_rpm_payload_installs_and_holds_a_limit_on_debian_11(packages: Packages, tmp_path: Path) -> None:
    with older_root(tmp_path) as root:
        rpm_requires_met(root, packages.new_rpm)
        # Debian 11's minbase has no rpm: this machine's installs into the
        # root (its own database there, dependencies checked above; the
        # scriptlets only talk to systemd, which a chroot has not).
        rpm = root.copy_in(packages.new_rpm, "/tmp/cgpu.rpm")
        root.host_path("/var/lib/rpm").mkdir(parents=True)
        install = ["rpm", "--root", root.path, "--dbpath", "/var/lib/rpm", "--nodeps", "--noscripts", "-i"]
        out = subprocess.run(root.beside([*install, root.path / rpm.lstrip("/")]), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert root.run("cgpuctl", "--version").stdout.strip() == f"cgpuctl {NEW}"
        env = sim_environment(root)
        with installed_cgpud(root, env) as log:
            holds_one_gib(root, env, log)
            doctor_passes(root, env)


def test_a_container_through_the_roots_runtime_and_runc_gets_its_limit(packages: Packages, tmp_path: Path) -> None:
    with older_root(tmp_path) as root:
        out = root.run("dpkg", "-i", root.copy_in(packages.new_deb, "/tmp/cgpu.deb"))
        assert out.returncode == 0, out.stdout + out.stderr
        runc = root.run("runc", "--version").stdout
        assert "runc version 1.0" in runc, runc
        env = sim_environment(root)
        bundle = root.host_path("/tmp/bundle")
        build_rootfs(bundle / "rootfs")
        assert root.run("runc", "spec", "--bundle", "/tmp/bundle").returncode == 0
        spec = json.loads((bundle / "config.json").read_text())
        spec["process"]["terminal"] = False
        spec["process"]["args"] = ["cgpu-burn", "--alloc-until-fail", "256MiB"]
        spec["process"]["env"] += ["CGPU_SIM_CONFIG=/sim/sim.conf", "CGPU_SIM_STATE=/sim/sim.state"]
        spec["root"] = {"path": "rootfs", "readonly": False}
        spec["mounts"].append({"destination": "/sim", "type": "bind", "source": "/sim", "options": ["rbind", "rw"]})
        # cgpu's request, as a standalone cGPU user writes `docker run -e`.
        spec["process"]["env"] += ["ALIYUN_COM_GPU_MEM_CONTAINER=1"]
        (bundle / "config.json").write_text(json.dumps(spec))
        with installed_cgpud(root, env) as log:
            out = root.run(
                "/usr/bin/cgpu-runtime",
                "run",
                "--bundle",
                "/tmp/bundle",
                "older-root-1",
                env=root.environment(CGPU_REAL_RUNTIME="/usr/sbin/runc"),
            )
            assert out.returncode == 0, out.stdout + out.stderr + log.read_text()[-3000:]
        burn = json.loads(out.stdout)
        assert burn["mem_total_reported"] == 1 * GIB and burn["alloc"]["until_fail_count"] == 4
