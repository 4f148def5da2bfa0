"""config.json reading and rewriting, and the rootfs link check, on real
files in a temp dir."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cgpud.errors import UsageError
from cgpud.containers.bundle import MAX_SPEC, check_targets, check_volumes, read_spec, rootfs_path, write_spec

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
    [
        ("etc", "/../../tmp/x"),
        ("run", "/proc/self/cwd"),
        ("usr/local", "../opt"),
        ("etc/ld.so.preload", "/proc/1/x"),
        ("usr", "/usr"),
    ],
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


def test_a_spec_over_the_limit_is_refused_and_one_at_it_is_read(tmp_path: Path) -> None:
    body = json.dumps({"root": {"path": "rootfs"}, "pad": ""})
    at_limit = body[:-2] + " " * (MAX_SPEC - len(body)) + body[-2:]
    (tmp_path / "config.json").write_text(at_limit)
    assert read_spec(tmp_path)["root"] == {"path": "rootfs"}
    (tmp_path / "config.json").write_text(at_limit + " ")
    with pytest.raises(UsageError, match="config.json is larger than 8 MiB"):
        read_spec(tmp_path)
    os.unlink(tmp_path / "config.json")
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(UsageError, match="config.json is not a regular file"):
        read_spec(tmp_path)


# ---- volumes over the paths cgpu mounts at (check_volumes)


def bind(dest: str, source: Path | str, kind: str = "bind") -> dict:
    return {"destination": dest, "type": kind, "source": str(source), "options": ["rbind", "ro"]}


@pytest.mark.parametrize(
    ("dest", "link", "target"),
    [
        ("/run", "cgpu", "/run/cgpu"),
        ("/etc", "ld.so.preload", "/etc/ld.so.preload"),
        ("/usr/local", "cgpu", "/usr/local/cgpu/libcgpu.so"),
        ("/usr", "local", "/usr/local/cgpu/libcgpu.so"),
        ("/", "run", "/run/cgpu"),
    ],
)
def test_a_link_in_a_volume_source_is_refused_naming_mount_and_link(tmp_path: Path, dest, link, target) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / link).symlink_to("/proc/self/cwd")
    with pytest.raises(UsageError) as e:
        check_volumes(tmp_path / "rootfs", [bind(dest, src)], TARGETS)
    assert f"the volume at {dest} (from {src})" in str(e.value)
    assert f"{src / link} -> /proc/self/cwd" in str(e.value) and target in str(e.value)


def test_tmpfs_unrelated_and_replaced_mounts_pass(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "cgpu").mkdir(parents=True)
    mounts = [
        {"destination": "/usr/local", "type": "tmpfs", "source": "tmpfs"},
        {"destination": "/run", "type": "tmpfs"},
        bind("/data", tmp_path / "missing"),
        bind("/run/cgpu/x", "/nonexistent"),
        bind("/etc/hosts", src),
        bind("/runner", src),
        "not a mount",
    ]
    check_volumes(tmp_path / "rootfs", mounts, TARGETS)
    # A mount exactly at one of cgpu's targets is replaced by cgpu's own.
    (tmp_path / "pre").symlink_to("/proc/self/cwd")
    check_volumes(tmp_path / "rootfs", [bind("/etc/ld.so.preload", tmp_path / "pre")], TARGETS, ours=TARGETS)
    # Spelt so that it is not replaced, it stays under cgpu's mount: refused.
    with pytest.raises(UsageError, match="could remove cgpu's mount points"):
        check_volumes(tmp_path / "rootfs", [bind("/etc//ld.so.preload", tmp_path / "pre")], TARGETS, ours=TARGETS)


@pytest.mark.parametrize("dest", ["/run", "/etc", "/usr", "/usr/local", "/usr/local/cgpu", "/", "/etc/"])
def test_a_bind_volume_over_a_target_is_refused_even_without_a_link(tmp_path: Path, dest: str) -> None:
    src = tmp_path / "src"
    (src / "cgpu").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"the volume at /\S* \(from .*\) covers .* could remove cgpu's mount points"):
        check_volumes(tmp_path / "rootfs", [bind(dest, src)], TARGETS)
    with pytest.raises(UsageError, match="could remove cgpu's mount points"):  # a source that is not there
        check_volumes(tmp_path / "rootfs", [bind(dest, "/nonexistent")], TARGETS)


def test_volumes_cgpu_cannot_look_into_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="a overlay mount at /usr covers /usr/local/cgpu/libcgpu.so"):
        check_volumes(
            tmp_path / "rootfs",
            [{"destination": "/usr", "type": "overlay", "source": "overlay", "options": []}],
            TARGETS,
        )
    src = tmp_path / "src"
    src.mkdir()
    (src / "usr").mkdir()
    (src / "usr" / "local").write_text("")
    with pytest.raises(UsageError, match="has a file at /usr/local .* needs a directory"):
        check_volumes(
            tmp_path / "rootfs",
            [{"destination": "/", "type": "none", "source": str(src), "options": ["bind"]}],
            TARGETS,
        )


def test_a_destination_counts_where_links_in_the_image_or_earlier_volumes_put_it(tmp_path: Path) -> None:
    root = rootfs(tmp_path)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "var" / "lock").symlink_to("../../../../run")  # clamped at the root, as runc does
    (root / "opt").symlink_to("usr/local")
    src = tmp_path / "src"
    src.mkdir()
    for written, lands in (
        ("/var/run", "/run"),
        ("/var/lock", "/run"),
        ("/opt", "/usr/local"),
        ("/var/run/../etc", "/etc"),
    ):
        with pytest.raises(UsageError, match=f"the volume at {lands} \\(written as {written}\\)"):
            check_volumes(root, [bind(written, src)], TARGETS)
    check_volumes(root, [{"destination": "/var/run", "type": "tmpfs", "source": "tmpfs"}], TARGETS)
    # A link inside an earlier volume's source sends a later mount over /etc.
    (src / "y").symlink_to("/etc")
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(UsageError, match=r"the volume at /etc \(written as /x/y\)"):
        check_volumes(root, [bind("/x", src), bind("/x/y", other)], TARGETS)
    # ...but not once a later mount covers that source, nor through a tmpfs.
    check_volumes(root, [bind("/x", src), {"destination": "/x", "type": "tmpfs"}, bind("/x/y", other)], TARGETS)
    (root / "loop").symlink_to("/loop")
    with pytest.raises(UsageError, match="more than 40 symbolic links"):
        check_volumes(root, [bind("/loop/a", src)], TARGETS)


@pytest.mark.parametrize(
    ("encoding", "text", "refused"),
    [
        ("utf-8", '"A=\\u0000x"', True),  # the escape, in UTF-8
        ("utf-16", '"A=\\u0000x"', True),  # the same in UTF-16, which json.loads also reads
        ("utf-32", '"\\u0000"', True),
        ("utf-8", '"A=\\\\u0000"', False),  # a backslash, then the text u0000: no NUL
        ("utf-8", '"caf\\u00e9 \\u0001"', False),
    ],
)
def test_a_nul_anywhere_in_the_spec_is_refused_whatever_its_encoding(
    tmp_path: Path, encoding: str, text: str, refused: bool
) -> None:
    """A NUL would make os.open() raise ValueError where a path is used; the
    check that finds it skips the walk only when the bytes cannot hold one."""
    (tmp_path / "config.json").write_bytes(
        f'{{"ociVersion": "1.0.2", "root": {{"path": "rootfs"}}, "process": {{"env": [{text}]}}}}'.encode(encoding)
    )
    if refused:
        with pytest.raises(UsageError, match="NUL character"):
            read_spec(tmp_path)
    else:
        assert "\0" not in read_spec(tmp_path)["process"]["env"][0]
