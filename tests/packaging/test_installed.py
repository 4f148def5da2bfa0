"""The deb installed on this machine (dpkg -i; CI runs as root on a
throwaway machine), purged at the end: /usr/bin/cgpud from the package,
started as the unit's ExecStart starts it (with a notify socket; no systemd
here), passes the source tree's memory-limit check with the package's own
cgpuctl, tools and simulated driver, found as `cgpuctl sim env` says."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from tests.packaging.conftest import NEW, Packages

# Installs the deb on this machine (dpkg, systemd unit, /opt/cgpu): host_global.
pytestmark = [pytest.mark.host_global, pytest.mark.slow]

UNIT = Path("/lib/systemd/system/cgpud.service")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def installed(packages: Packages) -> Iterator[Packages]:
    if run("dpkg-query", "-W", "cgpu").returncode == 0:
        pytest.fail("a cgpu package is already installed on this machine: purge it first")
    out = run("dpkg", "-i", str(packages.new_deb))
    try:
        assert out.returncode == 0, out.stderr
        yield packages
    finally:
        purged = run("dpkg", "--purge", "cgpu")
        assert purged.returncode == 0, purged.stderr
        assert not Path("/usr/bin/cgpud").exists() and not Path(f"/opt/cgpu/{NEW}").exists()


def exec_start() -> list[str]:
    line = next(ln for ln in UNIT.read_text().splitlines() if ln.startswith("ExecStart="))
    return line.removeprefix("ExecStart=").split()


def sim_exports(env: dict[str, str]) -> dict[str, str]:
    out = run("/usr/bin/cgpuctl", "sim", "env", env=env)
    assert out.returncode == 0, out.stderr
    return dict(re.findall(r'^export (\w+)="([^"]*)"', out.stdout, re.M))


def test_the_installed_cgpud_holds_a_memory_limit(installed: Packages, tmp_path: Path, sim_env) -> None:
    assert run("/usr/bin/cgpuctl", "--version").stdout.strip() == f"cgpuctl {NEW}"
    exported = sim_exports(dict(sim_env))
    sim_lib = f"/opt/cgpu/{NEW}/python/lib/python3.11/site-packages/cgpud/_native/sim"
    lib = exported["LD_LIBRARY_PATH"].split("${")[0]  # "<lib>${LD_LIBRARY_PATH:+:...}"
    tools = exported["PATH"].split(":$PATH")[0]
    assert lib == sim_lib  # the package's own simulated driver
    assert tools.startswith(f"/opt/cgpu/{NEW}/")  # its cgpu-burn
    # The simulated machine of this test (its config and state files), the
    # driver and tools the package names.
    env = dict(sim_env, LD_LIBRARY_PATH=lib, PATH=f"{tools}:{os.environ['PATH']}")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    env["NOTIFY_SOCKET"] = str(tmp_path / "notify.sock")
    sock = tmp_path / "run" / "cgpud.sock"
    # The unit's command line, with this test's state and sockets (tests of
    # the source tree may run beside it). It reads the package's conffile,
    # /etc/cgpu/config.toml, every line of it commented out.
    argv = [
        *exec_start(),
        "--state-dir",
        str(tmp_path / "state"),
        "--socket",
        str(sock),
        "--relay-socket",
        str(tmp_path / "run" / "relay.sock"),
    ]
    assert argv[0] == "/usr/bin/cgpud"
    with open(tmp_path / "cgpud.log", "w") as log:
        daemon = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        notify.settimeout(60)
        messages = []
        while b"READY=1" not in messages:
            messages.extend(notify.recv(4096).split(b"\n"))
        ctl = ["/usr/bin/cgpuctl", "--socket", str(sock)]
        out = run(*ctl, "run", "--mem", "1", "--", "cgpu-burn", "--alloc-until-fail", "256MiB", env=env)
        assert out.returncode == 0, out.stderr + (tmp_path / "cgpud.log").read_text()[-3000:]
        burn = json.loads(out.stdout)
        assert burn["mem_total_reported"] == 1 * GIB and burn["alloc"]["until_fail_count"] == 4
        # The library the tenant preloaded is the package's, copied by cgpud.
        runtime = list((tmp_path / "state" / "runtime").rglob("libcgpu.so"))
        packaged = Path(f"/opt/cgpu/{NEW}/python/lib/python3.11/site-packages/cgpud/_native/lib/libcgpu.so")
        assert runtime and all(p.read_bytes() == packaged.read_bytes() for p in runtime)
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
        notify.close()


def test_the_installed_unit_verifies_clean(installed: Packages) -> None:
    out = run("systemd-analyze", "verify", str(UNIT))
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_runtime_configure_names_the_stable_runtime_path(installed: Packages, tmp_path: Path) -> None:
    """Not the versioned copy under /opt, which the next upgrade removes."""
    config = tmp_path / "daemon.json"
    out = run("/usr/bin/cgpuctl", "runtime", "configure", "--docker", "--dry-run", "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert '"path": "/usr/bin/cgpu-runtime"' in out.stdout
    assert os.path.realpath("/usr/bin/cgpu-runtime").startswith(f"/opt/cgpu/{NEW}/")


def test_every_entry_point_and_the_kubernetes_side_import_from_the_package(installed: Packages) -> None:
    for tool in ("cgpud", "cgpuctl", "cgpu-scheduler", "kubectl-inspect-cgpu"):
        out = run(f"/usr/bin/{tool}", "--help")
        assert out.returncode == 0 and out.stdout.startswith("usage:"), (tool, out.stderr)
    python = f"/opt/cgpu/{NEW}/python/bin/python3.11"
    out = run(
        python,
        "-I",
        "-c",
        "import cgpud, cgpud.kube.agent, cgpud.kube.plugin, cgpud.extender.main, "
        "cgpud.daemon.metrics, cgpud._region, cgpud._scheduler, ssl, sqlite3, ctypes, yaml, urllib3, "
        "cgpud.kube.rest, cgpud.extender.bind; print(cgpud.__file__)",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"/opt/cgpu/{NEW}/")  # not the source tree's


def test_the_bundled_python_needs_nothing_of_the_build_machine(installed: Packages) -> None:
    """The interpreter the package was built from and the source tree,
    hidden under empty tmpfs mounts in a private mount namespace: the
    package's Python still starts, with its stdlib and C parts."""
    python = f"/opt/cgpu/{NEW}/python/bin/python3.11"
    hidden = [sys.base_prefix, str(Path(__file__).resolve().parents[2])]
    assert all(not p.startswith(("/usr", "/opt/cgpu")) for p in hidden)  # hiding these keeps sh working
    mounts = " && ".join(f"mount -t tmpfs cgpu-hide {p}" for p in hidden)
    check = "import sys, ssl, sqlite3, cgpud._region, cgpud._scheduler, grpc; print(sys.prefix)"
    out = run("unshare", "-m", "--propagation", "private", "sh", "-c", f"{mounts} && exec {python} -I -c '{check}'")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"/opt/cgpu/{NEW}/python"
    # One static interpreter: no libpython to find, no RUNPATH to relocate.
    readelf = run("readelf", "-d", python).stdout
    assert "libpython" not in readelf and "RUNPATH" not in readelf and "RPATH" not in readelf
