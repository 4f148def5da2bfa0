"""The rpm: its file list, and an install, an edited config and an erase in
a throwaway root with its own rpm database. rpm runs scriptlets chrooted in
the root; a static busybox is its /bin/sh, as on a minimal host."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.packaging.conftest import NEW, Packages
import pytest

pytestmark = pytest.mark.slow  # tens of seconds to minutes each

PY = "python3.11"


def rpm(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["rpm", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def test_rpm_lists_the_expected_files(packages: Packages) -> None:
    assert packages.new_rpm.name == f"cgpu-{NEW}-1.x86_64.rpm"
    files = set(rpm("-qlp", str(packages.new_rpm)).stdout.split())
    site = f"/opt/cgpu/{NEW}/python/lib/{PY}/site-packages"
    for path in (
        "/usr/bin/cgpud",
        "/usr/bin/cgpuctl",
        "/usr/bin/cgpu-scheduler",
        "/usr/bin/kubectl-inspect-cgpu",
        "/usr/bin/cgpu-runtime",
        "/usr/lib/systemd/system/cgpud.service",
        "/etc/cgpu/config.toml",
        f"/opt/cgpu/{NEW}/python/bin/{PY}",
        f"{site}/cgpud/_native/lib/libcgpu.so",
        f"{site}/cgpud/_native/sim/libcuda.so.1",
        f"{site}/cgpud-{NEW}.dist-info/METADATA",
    ):
        assert path in files, path
    assert not any(f.startswith("/var/") for f in files)
    requires = rpm("-qp", "--requires", str(packages.new_rpm)).stdout.splitlines()
    # RHEL's names (CentOS 7 to RHEL 9, Alibaba Cloud Linux 2 and 3): glibc,
    # and the C++ runtime grpcio's wheel links; the rest is in the bundled CPython.
    declared = [r for r in requires if not r.startswith("rpmlib(") and not r.startswith("/")]
    assert sorted(declared) == ["glibc >= 2.17", "libgcc", "libstdc++"], requires
    configs = rpm("-qcp", str(packages.new_rpm)).stdout.split()
    assert configs == ["/etc/cgpu/config.toml"]
    scripts = rpm("-qp", "--scripts", str(packages.new_rpm)).stdout
    for scriptlet in ("preinstall", "postinstall", "preuninstall", "postuninstall", "posttrans"):
        assert f"{scriptlet} scriptlet" in scripts, scriptlet
    assert "docker" not in scripts.lower() and "containerd" not in scripts


def test_the_rpm_has_an_xz_payload_and_sha256_digests_which_rpm_4_11_reads(packages: Packages) -> None:
    """CentOS 7's rpm 4.11 reads xz payloads (not zstd: 4.14) and sha256
    file digests (PGPHASHALGO 8)."""
    query = rpm("-qp", "--qf", "%{PAYLOADCOMPRESSOR} %{FILEDIGESTALGO}", str(packages.new_rpm)).stdout
    assert query.split() == ["xz", "8"]


def test_rpm_installs_into_a_root_and_erase_keeps_edits_and_state(packages: Packages, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(shutil.which("busybox") or "/bin/busybox", root / "bin" / "busybox")
    (root / "bin" / "sh").symlink_to("busybox")
    db = ["--root", str(root), "--dbpath", "/var/lib/rpm"]
    rpm(*db, "--initdb")
    rpm(*db, "-i", "--nodeps", str(packages.new_rpm))
    assert rpm(*db, "-q", "cgpu").stdout.strip() == f"cgpu-{NEW}-1.x86_64"
    assert (root / "usr/bin/cgpud").readlink() == Path(f"/opt/cgpu/{NEW}/bin/cgpud")
    assert (root / "usr/lib/systemd/system/cgpud.service").read_text().startswith("# cgpud")
    assert (
        root / f"opt/cgpu/{NEW}/python/lib/{PY}/site-packages/cgpud/_native/bin/cgpu-runtime"
    ).stat().st_mode & 0o111
    rpm(*db, "-V", "--nodeps", "cgpu")  # every file as packed

    config = root / "etc/cgpu/config.toml"
    config.write_text(config.read_text() + "sweep_interval = 1.0\n")
    (root / "var/lib/cgpud").mkdir(parents=True)
    (root / "var/lib/cgpud/cgpud.db").write_text("instances")
    rpm(*db, "-e", "cgpu")
    assert not (root / "opt/cgpu" / NEW).exists() and not (root / "usr/bin/cgpud").exists()
    assert (root / "var/lib/cgpud/cgpud.db").read_text() == "instances"  # rpm has no purge: docs/install.md
    assert (root / "etc/cgpu/config.toml.rpmsave").read_text().endswith("sweep_interval = 1.0\n")
