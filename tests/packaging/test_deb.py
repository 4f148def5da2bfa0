"""The deb in a throwaway root (dpkg --root with its own admin directory;
maintainer scripts run without chroot and act on $DPKG_ROOT): its files,
conffile handling across upgrades, removal and purge."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.conftest import NEW, OLD, REPO, Packages

pytestmark = pytest.mark.slow  # tens of seconds to minutes each

PY = "python3.11"


def dpkg(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        ["dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends", "--log=/dev/null", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out


def empty_root(path: Path) -> Path:
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates"):
        (path / d).mkdir(parents=True)
    for f in ("status", "available"):
        (path / "var/lib/dpkg" / f).touch()
    return path


def test_the_deb_declares_its_conffile_scripts_and_dependencies(packages: Packages) -> None:
    assert packages.new_deb.name == f"cgpu_{NEW}_amd64.deb"
    fields = subprocess.run(["dpkg-deb", "-f", str(packages.new_deb)], capture_output=True, text=True).stdout
    assert f"Version: {NEW}" in fields and "Architecture: amd64" in fields
    depends = next(line for line in fields.splitlines() if line.startswith("Depends:"))
    # OpenSSL, SQLite, libffi and the compression libraries are in the
    # bundled CPython: only glibc and grpcio's C++ runtime come from the system.
    assert "libc6 (>= 2.17)" in depends  # the newest GLIBC_ symbol version needed
    assert not re.search(r"libssl|libsqlite|libffi|liblzma|libbz2|zlib", depends), depends
    conffiles = subprocess.run(
        ["dpkg-deb", "-I", str(packages.new_deb), "conffiles"], capture_output=True, text=True
    ).stdout
    assert conffiles.split() == ["/etc/cgpu/config.toml"]
    listing = subprocess.run(["dpkg-deb", "-c", str(packages.new_deb)], capture_output=True, text=True).stdout
    owners = {line.split()[1] for line in listing.splitlines()}
    assert owners == {"root/root"}  # --root-owner-group, though built by whoever
    names = {line.split()[5].removeprefix(".") for line in listing.splitlines()}
    tops = {n.split("/")[1] for n in names if n.count("/") > 1}
    assert tops == {"etc", "lib", "opt", "usr"}  # nothing in /var: state is made by the unit, kept by removal
    stdlib = f"/opt/cgpu/{NEW}/python/lib/{PY}/"
    pruned = [
        n
        for n in names
        if n.startswith(stdlib)
        and not n.startswith(stdlib + "site-packages/")
        and ({"test", "tests", "tkinter", "idlelib", "ensurepip"} & set(n[len(stdlib) :].split("/")))
    ]
    assert pruned == []
    assert stdlib + "ctypes/__init__.py" in names and stdlib + "lib-dynload/" in names


def test_every_elf_file_of_both_packages_needs_at_most_glibc_2_17(packages: Packages, tmp_path) -> None:
    """The version needs (.gnu.version_r) of every ELF file in the deb and in
    the rpm, read by packaging/elf_needs.py as auditwheel reads them: the
    newest is GLIBC_2.17 (manylinux2014, CentOS 7), and it is what the deb's
    Depends and the rpm's Requires say."""
    deb, rpm = tmp_path / "deb", tmp_path / "rpm"
    subprocess.run(["dpkg-deb", "-x", str(packages.new_deb), str(deb)], check=True)
    rpm.mkdir()
    # rpm2archive (rpm 4.15+) writes the payload as a tar: no cpio needed.
    subprocess.run(f"rpm2archive - < {packages.new_rpm} | tar -xz", shell=True, cwd=rpm, check=True)
    newest = {}
    for root in (deb, rpm):
        out = subprocess.run(
            [sys.executable, str(REPO / "packaging" / "elf_needs.py"), str(root)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        newest[root.name] = out.stdout.split()[0].removeprefix("GLIBC_")
    assert newest["deb"] == newest["rpm"] == "2.17"
    fields = subprocess.run(["dpkg-deb", "-f", str(packages.new_deb), "Depends"], capture_output=True, text=True)
    assert f"libc6 (>= {newest['deb']})" in fields.stdout
    requires = subprocess.run(["rpm", "-qp", "--requires", str(packages.new_rpm)], capture_output=True, text=True)
    assert f"glibc >= {newest['rpm']}" in requires.stdout.splitlines()


def test_the_deb_is_xz_which_dpkg_reads_from_debian_9_and_ubuntu_16_04_on(packages: Packages) -> None:
    members = subprocess.run(["ar", "t", str(packages.new_deb)], capture_output=True, text=True, check=True).stdout
    assert members.split() == ["debian-binary", "control.tar.xz", "data.tar.xz"]


def test_install_upgrade_keeps_edits_remove_keeps_state_purge_deletes_it(packages: Packages, tmp_path: Path) -> None:
    root = empty_root(tmp_path / "root")
    dpkg(root, "-i", str(packages.old_deb))
    old_prefix = root / "opt/cgpu" / OLD
    site = old_prefix / "python/lib" / PY / "site-packages"
    for part in (
        "cgpud/_native/lib/libcgpu.so",
        "cgpud/_native/bin/cgpu-runtime",
        "cgpud/_native/bin/cgpu-hook",
        "cgpud/_native/sim/libcuda.so.1",
        "cgpud/_native/sim/libnvidia-ml.so.1",
        "grpc",
        "yaml",
        "urllib3",
        "prometheus_client",
        f"cgpud-{OLD}.dist-info/METADATA",
    ):
        assert (site / part).exists(), part
    assert not (site / "kubernetes").exists()  # cgpud/kube/rest.py makes the calls
    assert list(site.glob("cgpud/_region*.so")) and list(site.glob("cgpud/_scheduler*.so"))
    assert (old_prefix / "python/bin" / PY).exists()
    assert (root / "usr/bin/cgpud").readlink() == Path(f"/opt/cgpu/{OLD}/bin/cgpud")
    assert (root / "usr/bin/cgpu-runtime").readlink() == Path(
        f"/opt/cgpu/{OLD}/python/lib/{PY}/site-packages/cgpud/_native/bin/cgpu-runtime"
    )
    assert (old_prefix / "bin/cgpud").read_text().startswith(f"#!/opt/cgpu/{OLD}/python/bin/{PY} -IB\n")
    unit = (root / "lib/systemd/system/cgpud.service").read_text()
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "KillMode=process" in unit
    config = root / "etc/cgpu/config.toml"
    default = config.read_text()
    assert "# sweep_interval = 2.0" in default and all(
        not line or line.startswith("#") for line in default.splitlines()
    )  # every setting commented out

    # The operator edits the config; cgpud has made its state.
    config.write_text(default + "\nsweep_interval = 1.0\n")
    state = root / "var/lib/cgpud"
    state.mkdir(parents=True)
    (state / "cgpud.db").write_text("instances")

    # Upgrade, same default config: the edit stays, nothing to merge.
    dpkg(root, "-i", str(packages.new_deb))
    assert not old_prefix.exists()  # the old version's tree went with it
    assert (root / "usr/bin/cgpud").readlink() == Path(f"/opt/cgpu/{NEW}/bin/cgpud")
    assert config.read_text().endswith("sweep_interval = 1.0\n")
    assert not list(config.parent.glob("config.toml.dpkg-*"))
    assert (state / "cgpud.db").read_text() == "instances"

    # Upgrade to a package whose default changed: the edit stays, the new
    # default is put beside it (--force-confold, what an unattended upgrade
    # asks for).
    newer = repack_with_new_default(packages.new_deb, tmp_path)
    dpkg(root, "--force-confold", "-i", str(newer))
    assert config.read_text().endswith("sweep_interval = 1.0\n")
    assert "changed default" in (config.parent / "config.toml.dpkg-dist").read_text()

    dpkg(root, "--remove", "cgpu")
    assert not (root / "opt/cgpu" / NEW).exists() and not (root / "usr/bin/cgpud").exists()
    assert not (root / "lib/systemd/system/cgpud.service").exists()
    assert (state / "cgpud.db").read_text() == "instances"  # state stays
    assert config.exists()  # conffiles stay until purge

    # An instance's tmpfs, kept by cgpud across its restarts, is still mounted.
    region = state / "instances" / "cgpu-1"
    region.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "cgpu-test", str(region)], check=True)
    try:
        dpkg(root, "--purge", "cgpu")
    finally:
        if region.is_mount():
            subprocess.run(["umount", str(region)])
    assert not state.exists() and not config.parent.exists()


def repack_with_new_default(deb: Path, tmp_path: Path) -> Path:
    tree = tmp_path / "repack"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True)
    config = tree / "etc/cgpu/config.toml"
    config.write_text(config.read_text() + "\n# a changed default\n")
    control = tree / "DEBIAN/control"
    control.write_text(control.read_text().replace(f"Version: {NEW}", f"Version: {NEW}.1"))
    out = tmp_path / "newer.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zxz", "-z1", "-b", str(tree), str(out)], check=True, capture_output=True
    )
    return out


def test_the_unit_verifies_clean(tmp_path: Path) -> None:
    """systemd-analyze needs ExecStart to exist; test_installed verifies the
    installed unit as is."""
    unit = Path(__file__).resolve().parents[2] / "systemd" / "cgpud.service"
    copy = tmp_path / "cgpud.service"
    copy.write_text(unit.read_text().replace("ExecStart=/usr/bin/cgpud", "ExecStart=/bin/true"))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    # Proof the check bites: an unknown key is reported.
    copy.write_text(copy.read_text() + "[Service]\nBogus=1\n")
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True)
    assert "Unknown key 'Bogus'" in out.stderr


@pytest.mark.parametrize("script", ["prerm", "postinst", "postrm"])
def test_maintainer_scripts_never_touch_containerd_or_docker(script: str) -> None:
    text = (Path(__file__).resolve().parents[2] / "packaging" / "deb" / script).read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert code and not any("containerd" in line or "docker" in line.lower() for line in code)
