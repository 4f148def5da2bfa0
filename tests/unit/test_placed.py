"""Reading the container's mount table at createRuntime, and what it must
show for cgpu's mounts to count as in place."""

from __future__ import annotations

import os

import pytest

from cgpud.errors import UsageError
import cgpud.containers.placed as placed_module
from cgpud.containers.placed import MountPoint, check_placed, parse_mountinfo, read_mountinfo

ROOT = "/b/root fs"
TARGETS = ("/run/cgpu", "/run/cgpu/usage", "/usr/local/cgpu/libcgpu.so", "/etc/ld.so.preload")


def test_parse_mountinfo_fields_and_escapes() -> None:
    data = (
        b"22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        b"40 22 0:39 / /b/root\\040fs/run/cgpu ro,nosuid shared:5 master:1 - tmpfs cgpu-region rw\n"
        b"garbage\n41 22 0:40 / /x rw - \n"
    )
    assert parse_mountinfo(data) == [MountPoint("/", "ext4"), MountPoint("/b/root fs/run/cgpu", "tmpfs")]
    assert any(m.path == "/" for m in read_mountinfo(os.getpid()))


def test_parse_mountinfo_under_a_root_keeps_only_what_lies_there() -> None:
    data = (
        b"22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        b"30 22 0:30 / /b/root\\040fs rw - overlay overlay rw\n"
        b"31 30 0:31 / /b/root\\040fs/proc rw - proc proc rw\n"
        b"32 22 0:32 / /b/root\\040fs2/run rw - tmpfs tmpfs rw\n"  # a sibling whose name starts alike
        b"33 22 0:33 / /elsewhere/b/root\\040fs/run rw - tmpfs tmpfs rw\n"  # holds it, not below it
        b"40 30 0:39 / /b/root\\040fs/run/cgpu ro - tmpfs cgpu-region rw\n"
    )
    expected = [
        MountPoint(ROOT, "overlay"),
        MountPoint(f"{ROOT}/proc", "proc"),
        MountPoint(f"{ROOT}/run/cgpu", "tmpfs"),
    ]
    assert parse_mountinfo(data, under=ROOT) == expected
    assert parse_mountinfo(data, under=ROOT + "/") == expected
    # The same verdict as from the whole table: the filter drops nothing check_placed reads.
    assert [m for m in parse_mountinfo(data) if m.path == ROOT or m.path.startswith(ROOT + "/")] == expected
    tricky = "/b/a\\b\tc\nd"
    line = b"50 22 0:50 / /b/a\\134b\\011c\\012d/proc rw - proc proc rw\n"
    assert parse_mountinfo(line, under=tricky) == [MountPoint(f"{tricky}/proc", "proc")]


def placed(*extra: tuple[str, str]) -> list[MountPoint]:
    base = [MountPoint(ROOT, "overlay"), MountPoint(f"{ROOT}/proc", "proc")]
    return base + [MountPoint(ROOT + p, t) for p, t in extra]


OURS = tuple((t, "ext4") for t in TARGETS)


def test_in_place_passes_and_a_runtime_that_has_not_mounted_yet_is_not_checked() -> None:
    assert check_placed(placed(*OURS), ROOT, TARGETS) is True
    assert check_placed(placed(("/run", "tmpfs"), *OURS, ("/etc/hosts", "ext4")), ROOT + "/", TARGETS) is True
    assert check_placed([MountPoint(ROOT, "overlay")], ROOT, TARGETS) is False


@pytest.mark.parametrize(
    ("mounts", "message"),
    [
        (OURS[1:], "cgpu's mount at /run/cgpu is not in place"),
        ((("/srv/cgpu", "ext4"), *OURS[1:]), "cgpu's mount at /run/cgpu is not in place"),
        ((("/etc/ld.so.preload", "ext4"), *OURS), "2 mounts lie at /etc/ld.so.preload"),
        ((("/run", "ext4"), *OURS), "a ext4 mount lies over /run"),
        ((*OURS, ("/usr/local/cgpu", "overlay")), "a overlay mount lies over /usr/local/cgpu"),
    ],
)
def test_a_mount_out_of_place_is_refused(mounts, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_placed(placed(*mounts), ROOT, TARGETS)


def test_a_mount_table_over_the_limit_is_refused_and_a_missing_process_named(monkeypatch) -> None:
    monkeypatch.setattr(placed_module, "MAX_MOUNTINFO", 100)  # a mount table has more than one line
    with pytest.raises(UsageError, match="mount table of process .* is larger than"):
        read_mountinfo(os.getpid())
    with pytest.raises(UsageError, match="cannot read the mounts of the container's init process"):
        read_mountinfo(2**22 + 1)  # above pid_max's ceiling: no such process
