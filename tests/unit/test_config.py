"""cgpud's settings as the file and the flags give them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgpud import config
from cgpud.node.model import ComputePolicy
from cgpud.errors import UsageError


def test_a_text_setting_is_read_from_the_file_and_the_flags(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text('mode = "core_mem"\ngpu_compute_policy = "1=3"\n')
    assert config.load(path, {}).policy().policy_for(1) is ComputePolicy.FIXED
    assert config.load(path, {"gpu_compute_policy": "1=4"}).policy().policy_for(1) is ComputePolicy.SOFT


def test_a_text_setting_given_a_number_is_refused(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text("gpu_compute_policy = 3\n")
    with pytest.raises(UsageError, match="setting gpu_compute_policy = 3 is not valid"):
        config.load(path, {})


def test_a_relative_dev_root_is_refused_and_an_absolute_one_is_kept(tmp_path: Path):
    path = tmp_path / "config.toml"
    path.write_text('dev_root = "run/nvidia/driver"\n')
    with pytest.raises(UsageError, match="dev_root must be an absolute path, not 'run/nvidia/driver'"):
        config.load(path, {})
    assert config.load(path, {"dev_root": "/run/nvidia/driver"}).dev_root == Path("/run/nvidia/driver")
