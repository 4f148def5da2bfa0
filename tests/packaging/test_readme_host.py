"""README.md's `host` blocks, run by bash as they stand in a booted
Debian 12 (tests/harness/systemd_root.py) with the deb where the block
names it (issue 41). The machine's part is what a GPU host has before the
README: the driver (simulated, given to cgpud.service by a drop-in and to
the shell by its environment) and the package file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.harness.readme import Block, readme_blocks
from tests.harness.systemd_root import booted_systemd, give_simulated_gpu
from tests.packaging.conftest import Packages

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def deb_name(block: Block) -> str:
    """The package file the block installs, of the version being built."""
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    named = re.search(r"\./(cgpu_[^ ]+\.deb)", block.text)
    assert named, f"{block.where}: no ./cgpu_*.deb in the block"
    assert named[1] == f"cgpu_{version}_amd64.deb", f"{block.where} names {named[1]}, the version is {version}"
    return named[1]


def test_the_readmes_host_blocks_run_in_order_on_a_booted_debian(
    packages: Packages, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    host = readme_blocks("host")
    assert host
    with booted_systemd(tmp_path) as root:
        env = give_simulated_gpu(root)
        for block in host:
            if ".deb" in block.text:
                root.copy_in(packages.new_deb, f"/root/{deb_name(block)}")
            out = root.run("bash", "-e", "-c", f"cd /root\n{block.text}", env=env, timeout=300)
            record_property("readme_block", block.where)
            assert out.returncode == 0, (
                f"{block.where} failed:\n{block.text}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
            if "systemctl is-active cgpud" in block.text:
                assert "active" in out.stdout.split(), out.stdout
