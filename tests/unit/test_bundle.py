"""config.json reading and rewriting, and the rootfs link check, on real
files in a temp dir."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cgpud.errors import UsageError
from cgpud.hook.bundle import check_targets, read_spec, rootfs_path, write_spec

TARGETS = ["/run/cgpu", "/usr/local/cgpu/libcgpu.so", "/etc/ld.so.preload"]


def rootfs(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    for d in ("etc", "run", "usr/local"):
        (root / d).mkdir(parents=True)
    return root


def test_plain_rootfs_and_missing_paths_pass(tmp_path: Path) -> None:
    check_targets(rootfs(tmp_path), TARGETS)
    empty = tmp_path / "empty"
    empty.mkdir()
    check_targets(empty, TARGETS)  # the runtime creates them as directories


@pytest.mark.parametrize(
    ("link", "target"),
    [("etc", "/../../tmp/x"), ("run", "/proc/self/cwd"), ("usr/local", "../opt"), ("etc/ld.so.preload", "/proc/1/x"),
     ("usr", "/usr")],
)
def test_a_symlink_on_the_way_is_refused(tmp_path: Path, link: str, target: str) -> None:
    root = rootfs(tmp_path)
    path = root / link
    if path.is_dir():
        os.rename(path, tmp_path / "moved")
    path.symlink_to(target)
    with pytest.raises(UsageError, match=f"the image makes /{link} a symbolic link \\(to {target}\\)"):
        check_targets(root, TARGETS)


def test_a_file_where_a_directory_is_needed_is_refused(tmp_path: Path) -> None:
    root = rootfs(tmp_path)
    (root / "run").rmdir()
    (root / "run").write_text("")
    with pytest.raises(UsageError, match="the image has a file at /run where cgpu needs a directory"):
        check_targets(root, TARGETS)


def test_spec_round_trip_keeps_mode_and_refuses_links(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}}))
    os.chmod(bundle / "config.json", 0o600)
    spec = read_spec(bundle)
    spec["process"] = {"env": ["A=1"]}
    write_spec(bundle, spec)
    assert read_spec(bundle) == spec
    assert (bundle / "config.json").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in bundle.iterdir()) == ["config.json"]  # no temp file left
    assert rootfs_path(bundle, spec) == bundle / "rootfs"
    assert rootfs_path(bundle, {"root": {"path": "/abs/root"}}) == Path("/abs/root")
    link = tmp_path / "l"
    link.mkdir()
    (link / "config.json").symlink_to(bundle / "config.json")
    with pytest.raises(UsageError, match="cannot read .*config.json"):
        read_spec(link)


@pytest.mark.parametrize(("text", "message"), [("{", "is not valid JSON"), ("[]", "is not a JSON object")])
def test_bad_specs(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UsageError, match=message):
        read_spec(tmp_path)
    with pytest.raises(UsageError, match="root.path is missing"):
        rootfs_path(tmp_path, {})
