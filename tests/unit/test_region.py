"""The instance region as cgpud writes and watches it: real files in tmp_path,
real tenant processes that claim ledgers, charge, and die."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cgpud._region import ffi, lib
from cgpud.node.region import GRANTS_FILE, LIMITS_FILE, MAX_DEVICES, MAX_PROCS, USAGE_FILE, DeviceLimit, InstanceLimits
from cgpud.node.region import LiveLimits, RegionError, Shrink, UsageRegion, read_limits, resize_live_limits
from cgpud.node.region import usage_problem, write_region
from tests.harness.usage_tenant import TenantUsage

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
GIB = 1 << 30


def one_gpu(mem_limit: int = 4 * GIB, instance_id: str = "inst-1") -> InstanceLimits:
    return InstanceLimits(instance_id, (DeviceLimit("GPU-0", mem_limit, host_index=0),))


# ------------------------------------------------------------ tenants

# A stand-in for a process of the instance running under libcgpu.so: claims
# a ledger, charges, reports on stdout, holds the ledger until stdin closes.
TENANT = """
import os, sys
from pathlib import Path
from tests.harness.usage_tenant import TenantUsage
directory, mode, device, limit, chunk = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
with TenantUsage(Path(directory)) as region:
    if mode == "claim-on-go":  # start together with others on "go"
        print("waiting", flush=True)
        sys.stdin.readline()
        mode = "once"
    ledger = region.claim(os.getpid())
    if mode == "once":
        print("ready", ledger, int(region.charge(ledger, device, limit, chunk)), flush=True)
    elif mode == "torn":  # as if killed between the two halves of a charge
        print("ready", ledger, int(region.reserve_unrecorded(device, limit, chunk)), flush=True)
    else:  # fill: on "go", charge chunks until refused
        print("ready", ledger, flush=True)
        sys.stdin.readline()
        total = 0
        while region.charge(ledger, device, limit, chunk):
            total += chunk
        print("done", ledger, total, flush=True)
    sys.stdin.readline()
"""


@dataclass
class Tenant:
    proc: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, word: str) -> list[int]:
        """The numbers on the tenant's next line, which must start with `word`."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # EOF if the tenant died: no hang
        assert line.split()[:1] == [word], f"tenant {self.pid} said {line!r}"
        return [int(x) for x in line.split()[1:]]

    def tell(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=10) == -signal.SIGKILL

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=10) == 0


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Tenant]]:
    started: list[Tenant] = []

    def start(mode: str, device: int, limit: int, chunk: int, directory: Path = tmp_path) -> Tenant:
        proc = subprocess.Popen(
            [sys.executable, "-c", TENANT, str(directory), mode, str(device), str(limit), str(chunk)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,  # the tenant imports tests.harness.usage_tenant
        )
        started.append(Tenant(proc))
        return started[-1]

    yield start
    for tenant in started:
        if tenant.proc.poll() is None:
            tenant.proc.kill()
        tenant.proc.wait(timeout=10)
        for stream in (tenant.proc.stdin, tenant.proc.stdout):
            if stream is not None:
                stream.close()


# ------------------------------------------------------- limits values

MAXED = InstanceLimits(
    "i" * 63,
    tuple(
        DeviceLimit(f"GPU-{n:02d}".ljust(95, "x"), 2**64 - 1, n, core_percent=100, weight=2**32 - 1, priority=n)
        for n in range(MAX_DEVICES)
    ),
    log_level=3,
    compute_policy=2**32 - 1,
)


@pytest.mark.parametrize(
    "limits",
    [
        pytest.param(one_gpu(), id="one-gpu"),
        pytest.param(
            InstanceLimits(
                "pod-a/c",
                (DeviceLimit("GPU-a", 0, 3), DeviceLimit("GPU-b", 5 * GIB + 1, 1, core_percent=30, weight=2)),
                log_level=1,
                compute_policy=0,
            ),
            id="two-gpus-zero-limit",
        ),
        pytest.param(MAXED, id="every-field-at-its-maximum"),
    ],
)
def test_limits_roundtrip(tmp_path: Path, limits: InstanceLimits) -> None:
    write_region(tmp_path / "r", limits)
    assert read_limits(tmp_path / "r") == limits
    # Temp files were renamed into place, none left behind.
    assert sorted(os.listdir(tmp_path / "r")) == sorted([GRANTS_FILE, LIMITS_FILE, USAGE_FILE])


def test_modes_do_not_depend_on_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_region(tmp_path / "a" / "b", one_gpu())
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "a" / "b") == 0o755
    assert mode(tmp_path / "a" / "b" / LIMITS_FILE) == 0o644
    assert mode(tmp_path / "a" / "b" / USAGE_FILE) == 0o666


def test_new_usage_file_is_empty(tmp_path: Path) -> None:
    write_region(tmp_path, one_gpu())
    data = (tmp_path / USAGE_FILE).read_bytes()
    header = ffi.offsetof("struct cgpu_usage", "device")
    assert len(data) == ffi.sizeof("struct cgpu_usage")
    assert data[header:] == bytes(len(data) - header)
    with TenantUsage(tmp_path) as region:
        assert region.ledgers() == []


@pytest.mark.parametrize("gated", [False, True])
def test_a_fresh_region_is_written_in_place_as_the_renaming_path_writes_it(tmp_path: Path, gated: bool) -> None:
    renamed, fresh = tmp_path / "renamed", tmp_path / "fresh"
    fresh.mkdir()
    old = os.umask(0o077)
    try:
        write_region(renamed, one_gpu(), gated=gated)
        write_region(fresh, one_gpu(), gated=gated, fresh=True)
    finally:
        os.umask(old)
    for name in (LIMITS_FILE, USAGE_FILE, GRANTS_FILE):
        a, b = os.stat(renamed / name), os.stat(fresh / name)
        assert (fresh / name).read_bytes() == (renamed / name).read_bytes(), name
        assert stat.S_IMODE(b.st_mode) == stat.S_IMODE(a.st_mode), name
    # The usage file's pages are allocated, so a write through a mapping cannot fail later.
    assert os.stat(fresh / USAGE_FILE).st_blocks * 512 >= ffi.sizeof("struct cgpu_usage")
    assert sorted(os.listdir(fresh)) == sorted([GRANTS_FILE, LIMITS_FILE, USAGE_FILE])
    assert read_limits(fresh) == one_gpu()


def test_a_fresh_region_never_writes_through_what_is_already_there(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    region = tmp_path / "r"
    region.mkdir()
    (region / USAGE_FILE).symlink_to(outside)
    with pytest.raises(RegionError, match="cannot write the region of instance inst-1"):
        write_region(region, one_gpu(), fresh=True)
    assert outside.read_bytes() == b"keep"


def _device(**kw: Any) -> DeviceLimit:
    return DeviceLimit(**{"uuid": "GPU-0", "mem_limit": GIB, "host_index": 0, **kw})


def _instance(**kw: Any) -> InstanceLimits:
    return InstanceLimits(**{"instance_id": "inst", "devices": (_device(),), **kw})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: _instance(devices=()), "instance inst has 0 devices; 1 to 16 allowed", id="no-device"),
        pytest.param(
            lambda: _instance(devices=tuple(_device(uuid=f"GPU-{n}") for n in range(17))),
            "instance inst has 17 devices; 1 to 16 allowed",
            id="17-devices",
        ),
        pytest.param(
            lambda: _instance(devices=(_device(), _device(host_index=1))),
            "instance inst names device GPU-0 more than once",
            id="duplicate-uuid",
        ),
        pytest.param(lambda: _device(uuid=""), "device UUID is empty", id="empty-uuid"),
        pytest.param(lambda: _device(uuid="G" * 96), "is 96 bytes; at most 95 fit", id="uuid-too-long"),
        pytest.param(lambda: _device(uuid="GPU-\0x"), "contains a NUL character", id="uuid-nul"),
        pytest.param(lambda: _instance(instance_id=""), "instance id is empty", id="empty-instance-id"),
        pytest.param(lambda: _instance(instance_id="i" * 64), "is 64 bytes; at most 63 fit", id="instance-id-too-long"),
        pytest.param(
            lambda: _device(mem_limit=-1),
            "memory limit of GPU-0 is -1; it must be between 0 and 18446744073709551615",
            id="negative-mem-limit",
        ),
        pytest.param(lambda: _device(mem_limit=2**64), "memory limit of GPU-0 is 18446744073709551616", id="huge-mem"),
        pytest.param(
            lambda: _device(core_percent=101),
            "core percent of GPU-0 is 101; it must be between 0 and 100",
            id="core-101",
        ),
        pytest.param(lambda: _device(core_percent=-1), "core percent of GPU-0 is -1", id="core-negative"),
        pytest.param(lambda: _device(host_index=-1), "host index of GPU-0 is -1", id="host-index-negative"),
        pytest.param(
            lambda: _instance(log_level=4), "log level of instance inst is 4; it must be between 0 and 3", id="log-4"
        ),
        pytest.param(lambda: _instance(log_level=-1), "log level of instance inst is -1", id="log-negative"),
    ],
)
def test_invalid_limits_are_refused(make: Callable[[], object], message: str) -> None:
    with pytest.raises(RegionError, match=re.escape(message)):
        make()


# ---------------------------------------------------- damaged limits file


def _patch_struct(path: Path, ctype: str, edit: Callable[[Any], None]) -> None:
    data = bytearray(path.read_bytes())
    edit(ffi.from_buffer(f"{ctype} *", data, require_writable=True))
    path.write_bytes(bytes(data))


def _flip_mem_limit_byte(path: Path) -> None:
    # The top byte of GPU 0's limit: a tampered file that would raise the limit.
    at = ffi.offsetof("struct cgpu_limits", "device") + ffi.offsetof("struct cgpu_device_limit", "mem_limit") + 7
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _set_log_level_resealed(path: Path) -> None:
    # Valid for C (checksum recomputed) but out of range for Python.
    def edit(raw: Any) -> None:
        raw.log_level = 9
        raw.checksum = lib.cgpu_region_checksum(raw, ffi.offsetof("struct cgpu_limits", "checksum"))

    _patch_struct(path, "struct cgpu_limits", edit)


def _set(field: str, value: int) -> Callable[[Path], None]:
    return lambda path: _patch_struct(path, "struct cgpu_limits", lambda raw: setattr(raw, field, value))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param(_flip_mem_limit_byte, "limits region checksum mismatch: the file is damaged", id="flipped-byte"),
        pytest.param(_set("magic", 0x1234), "not a cgpu limits region (bad size or magic)", id="magic"),
        pytest.param(
            _set("version", 3),
            f"limits region version 3 (size {ffi.sizeof('struct cgpu_limits')}); this library reads version 2",
            id="version",
        ),
        pytest.param(_set("size", 2016), "limits region version 2 (size 2016)", id="size-field"),
        pytest.param(lambda p: os.truncate(p, 100), "not a cgpu limits region (bad size or magic)", id="truncated"),
        pytest.param(lambda p: os.truncate(p, 0), "not a cgpu limits region (bad size or magic)", id="empty"),
        pytest.param(_set("device_count", 0), "limits region checksum mismatch", id="device-count-unsealed"),
        pytest.param(_set_log_level_resealed, "limits region log level 9 is not 0-3", id="log-level-resealed"),
        pytest.param(os.unlink, "cannot read limits region", id="missing"),
    ],
)
def test_damaged_limits_are_refused_naming_the_file(
    tmp_path: Path, damage: Callable[[Path], None], message: str
) -> None:
    write_region(tmp_path, one_gpu())
    path = tmp_path / LIMITS_FILE
    read_limits(tmp_path)  # valid before the damage
    damage(path)
    with pytest.raises(RegionError) as caught:
        read_limits(tmp_path)
    assert message in str(caught.value)
    assert str(path) in str(caught.value)


# ----------------------------------------------------------- usage file


def test_rewriting_limits_keeps_a_valid_usage_file(tmp_path: Path) -> None:
    write_region(tmp_path, one_gpu(4 * GIB))
    inode = os.stat(tmp_path / USAGE_FILE).st_ino
    with TenantUsage(tmp_path) as region:
        ledger = region.claim(4242)
        assert region.charge(ledger, 0, 4 * GIB, 3 * MIB)
        write_region(tmp_path, one_gpu(8 * GIB))  # while a process holds a ledger
        assert region.device_used(0) == 3 * MIB
    assert read_limits(tmp_path).devices[0].mem_limit == 8 * GIB
    assert os.stat(tmp_path / USAGE_FILE).st_ino == inode
    with TenantUsage(tmp_path) as region:
        assert region.device_used(0) == 3 * MIB
        assert [(lg.pid, lg.used[0]) for lg in region.ledgers()] == [(4242, 3 * MIB)]


def _usage_set(field: str, value: int) -> Callable[[Path], None]:
    return lambda path: _patch_struct(path, "struct cgpu_usage", lambda raw: setattr(raw, field, value))


def _symlink_elsewhere(path: Path) -> None:
    target = path.parent / "elsewhere"
    os.replace(path, target)
    path.symlink_to(target)


USAGE_DAMAGE = [
    pytest.param(_usage_set("magic", 7), "not a cgpu usage region (bad size or magic)", id="magic"),
    pytest.param(
        _usage_set("version", 3), f"usage region version 3 (size {ffi.sizeof('struct cgpu_usage')})", id="version"
    ),
    pytest.param(_usage_set("size", 64), "usage region version 2 (size 64)", id="size-field"),
    pytest.param(lambda p: os.truncate(p, 1000), "not a cgpu usage region (bad size or magic)", id="truncated"),
    pytest.param(lambda p: os.truncate(p, 0), "not a cgpu usage region (bad size or magic)", id="empty"),
    pytest.param(_symlink_elsewhere, "cannot open usage region", id="symlink"),
    pytest.param(lambda p: os.truncate(p, 1 << 40), "not a cgpu usage region (bad size or magic)", id="grown-1TiB"),
]


@pytest.mark.parametrize(("damage", "message"), USAGE_DAMAGE)
def test_damaged_usage_is_refused_naming_the_file(tmp_path: Path, damage: Callable[[Path], None], message: str) -> None:
    write_region(tmp_path, one_gpu())
    damage(tmp_path / USAGE_FILE)
    with pytest.raises(RegionError) as caught:
        UsageRegion(tmp_path)
    assert message in str(caught.value)
    assert str(tmp_path / USAGE_FILE) in str(caught.value)


@pytest.mark.parametrize(("damage", "message"), USAGE_DAMAGE)
def test_damaged_usage_is_repaired(tmp_path: Path, damage: Callable[[Path], None], message: str) -> None:
    write_region(tmp_path, one_gpu())
    with TenantUsage(tmp_path) as region:
        assert region.charge(region.claim(1), 0, GIB, MIB)
    damage(tmp_path / USAGE_FILE)
    assert usage_problem(tmp_path) is not None
    write_region(tmp_path, one_gpu())
    path = tmp_path / USAGE_FILE
    assert not path.is_symlink()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
    assert os.stat(path).st_size == ffi.sizeof("struct cgpu_usage")
    assert usage_problem(tmp_path) is None
    with TenantUsage(tmp_path) as region:
        region.reap()  # a scribbled header keeps the counters; the dead ledger goes back
        assert region.device_used(0) == 0
        assert region.ledgers() == []


def test_usage_is_repaired_in_place_so_mappings_stay_coherent(tmp_path: Path) -> None:
    write_region(tmp_path, one_gpu())
    path = tmp_path / USAGE_FILE
    inode = os.stat(path).st_ino
    with TenantUsage(tmp_path) as region:
        ledger = region.claim(5)
        assert region.charge(ledger, 0, GIB, MIB)
        _usage_set("magic", 7)(path)
        os.truncate(path, 1 << 40)
        write_region(tmp_path, one_gpu())
        assert os.stat(path).st_ino == inode
        assert region.device_used(0) == MIB  # the same pages: the tenant's counters survive
        assert region.ledgers()[0].pid == 5


def test_a_usage_file_truncated_under_the_mapping_reads_zeros_and_is_refused(tmp_path: Path) -> None:
    write_region(tmp_path, one_gpu())
    with TenantUsage(tmp_path) as region:
        assert region.charge(region.claim(5), 0, GIB, MIB)
        os.truncate(tmp_path / USAGE_FILE, 0)
        assert not region.damaged
        with pytest.raises(RegionError, match="0 bytes now"):
            region.ledgers()
        # What a read between the size check and the truncation sees: zeros, no SIGBUS.
        assert region._u.device[0].used == 0
        assert region.damaged
        with pytest.raises(RegionError, match="truncated while mapped"):
            region.reap()


# ------------------------------------------------------- charging, reaping


def test_refused_charge_changes_nothing(tmp_path: Path) -> None:
    write_region(tmp_path, one_gpu())
    with TenantUsage(tmp_path) as region:
        ledger = region.claim(7)
        assert region.charge(ledger, 1, MIB, MIB)
        assert not region.charge(ledger, 1, MIB, 1)
        assert region.device_used(1) == MIB
        assert region.ledgers()[0].used[1] == MIB
        with pytest.raises(RegionError, match="ledger 999 was not claimed"):
            region.charge(999, 0, GIB, 1)
        with pytest.raises(RegionError, match="device index is 16; it must be between 0 and 15"):
            region.charge(ledger, MAX_DEVICES, GIB, 1)


def test_a_shrink_and_a_charge_in_either_order_never_leave_usage_over_the_new_limit(tmp_path: Path) -> None:
    """The resize protocol (region_ops.h) step by step, in the two orders
    that matter: a charge that read the old limit before cgpud stored the
    new one and reserved after cgpud read the usage is given back by its
    re-check; one that reserved before that read makes cgpud's store report
    the usage over, and cgpud puts the old limit back."""
    write_region(tmp_path, one_gpu(2 * GIB))
    with TenantUsage(tmp_path) as region, LiveLimits(tmp_path) as live:
        ledger = region.claim(7)
        grants = live._g
        assert live.current(0) == 2 * GIB  # write_region publishes the live limit
        assert region.charge(ledger, 0, 2 * GIB, 900 * MIB)

        old = live.current(0)  # the charger reads the limit ...
        assert live.store(0, 1000 * MIB) == 900 * MIB  # ... cgpud shrinks: usage fits, accepted ...
        assert region.charge(ledger, 0, old, 150 * MIB)  # ... the reserve under the old limit passes ...
        over = lib.cgpu_usage_over_live(region._mapped(), 0, ffi.addressof(grants.device[0], "mem_limit"), old)
        assert over  # ... and its re-check sees the new limit: libcgpu gives it back
        lib.cgpu_ledger_uncharge(region._mapped(), ledger, 0, 150 * MIB)
        assert region.device_used(0) == 900 * MIB

        # The other order: the reserve lands first, cgpud sees it and refuses.
        assert region.charge(ledger, 0, live.current(0), 100 * MIB)
        assert resize_live_limits(tmp_path, {0: 900 * MIB}) == (Shrink(0, 1000 * MIB),)
        assert live.current(0) == 1000 * MIB
        assert not lib.cgpu_usage_over_live(
            region._mapped(), 0, ffi.addressof(grants.device[0], "mem_limit"), 1000 * MIB
        )


def test_own_ledgers_are_distinct_and_not_reaped(tmp_path: Path) -> None:
    write_region(tmp_path, one_gpu())
    with TenantUsage(tmp_path) as region:
        first, second = region.claim(10), region.claim(11)
        assert first != second
        assert region.charge(first, 0, GIB, MIB)
        assert region.charge(second, 0, GIB, 2 * MIB)
        assert region.reap() == 0
        assert {(lg.pid, lg.used[0]) for lg in region.ledgers()} == {(10, MIB), (11, 2 * MIB)}
        assert region.device_used(0) == 3 * MIB


def test_killed_tenant_is_reaped(tmp_path: Path, spawn: Callable[..., Tenant]) -> None:
    write_region(tmp_path, one_gpu())
    tenant = spawn("once", 0, 4 * GIB, GIB)
    assert tenant.expect("ready")[1] == 1  # charged
    with TenantUsage(tmp_path) as region:
        assert region.device_used(0) == GIB
        assert [(lg.pid, lg.used[0]) for lg in region.ledgers()] == [(tenant.pid, GIB)]
        assert region.reap() == 0  # alive: its lock is held
        tenant.kill()
        assert region.reap() == 1
        assert region.device_used(0) == 0
        assert region.ledgers() == []
        assert region.reap() == 0


def test_live_tenant_is_not_reaped(tmp_path: Path, spawn: Callable[..., Tenant]) -> None:
    write_region(tmp_path, one_gpu())
    dead, live = spawn("once", 0, 4 * GIB, GIB), spawn("once", 0, 4 * GIB, GIB)
    assert dead.expect("ready")[1] == 1
    assert live.expect("ready")[1] == 1
    with TenantUsage(tmp_path) as region:
        assert region.device_used(0) == 2 * GIB
        dead.kill()
        assert region.reap() == 1
        assert region.device_used(0) == GIB
        assert [(lg.pid, lg.used[0]) for lg in region.ledgers()] == [(live.pid, GIB)]
        live.exit()  # a clean exit drops the lock too: reapable now
        assert region.reap() == 1
        assert region.device_used(0) == 0


def test_a_charge_torn_by_a_kill_comes_back_when_no_process_lives(tmp_path: Path, spawn: Callable[..., Tenant]) -> None:
    write_region(tmp_path, one_gpu())
    torn, live = spawn("torn", 0, 4 * GIB, GIB), spawn("once", 0, 4 * GIB, MIB)
    assert torn.expect("ready")[1] == 1
    assert live.expect("ready")[1] == 1
    torn.kill()
    with TenantUsage(tmp_path) as region:
        assert region.reap() == 1
        # Reaping cannot tell the torn gigabyte from a live charge in flight.
        assert region.device_used(0) == GIB + MIB
        newcomer = spawn("once", 0, 4 * GIB, MIB)
        assert newcomer.expect("ready")[1] == 1
        assert region.device_used(0) == GIB + 2 * MIB, "recounted while a process lived"
        live.exit()
        newcomer.exit()
        assert region.reap() == 2
        assert region.device_used(0) == GIB
        # The next process to start finds nobody alive and recounts.
        last = spawn("once", 0, 4 * GIB, MIB)
        assert last.expect("ready")[1] == 1
        assert region.device_used(0) == MIB
        assert [(lg.pid, lg.used[0]) for lg in region.ledgers()] == [(last.pid, MIB)]


def test_a_claim_turn_held_for_good_delays_a_claim_boundedly_and_skips_the_recount(
    tmp_path: Path, spawn: Callable[..., Tenant]
) -> None:
    """A process stopped mid-claim keeps the turn: the next claim waits at
    most 2 s, then goes on without it (and so without recounting)."""
    write_region(tmp_path, one_gpu())
    torn = spawn("torn", 0, 4 * GIB, GIB)
    assert torn.expect("ready")[1] == 1
    torn.kill()
    turn = ffi.sizeof("struct cgpu_usage") + MAX_PROCS  # the byte after the last ledger's
    fd = os.open(tmp_path / USAGE_FILE, os.O_RDWR)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, turn, 1, 0))
        started = time.monotonic()
        waiter = spawn("once", 0, 4 * GIB, MIB)
        assert waiter.expect("ready")[1] == 1
        assert 1.5 < time.monotonic() - started < 10
        with TenantUsage(tmp_path) as region:
            assert region.device_used(0) == GIB + MIB  # no turn, no recount
    finally:
        os.close(fd)
    waiter.exit()
    last = spawn("once", 0, 4 * GIB, MIB)
    assert last.expect("ready")[1] == 1
    with TenantUsage(tmp_path) as region:
        assert region.device_used(0) == MIB


def test_claims_racing_recounts_never_fail(tmp_path: Path) -> None:
    """Threads that each open, claim and drop (cffi releases the GIL, so the
    claims race in C): whoever finds the instance empty recounts, and a claim
    meanwhile must wait for it, not find every ledger locked."""
    write_region(tmp_path, one_gpu())
    refused: list[str] = []

    def start_and_exit_repeatedly() -> None:
        for _ in range(400):
            with TenantUsage(tmp_path) as region:
                try:
                    region.claim(os.getpid())
                except RegionError as e:
                    refused.append(str(e))

    threads = [threading.Thread(target=start_and_exit_repeatedly) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert refused == []
    # And with one process alive throughout, no recount takes its charge.
    with TenantUsage(tmp_path) as holder:
        ledger = holder.claim(os.getpid())
        assert holder.charge(ledger, 0, 4 * GIB, MIB)
        threads = [threading.Thread(target=start_and_exit_repeatedly) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert [lg.used[0] for lg in holder.ledgers() if lg.index == ledger] == [MIB]
        assert holder.device_used(0) == MIB
    assert refused == []


@pytest.mark.parametrize(
    ("device", "limit"),
    [pytest.param(0, 4 * GIB, id="4GiB-dev0"), pytest.param(15, 16 * GIB, id="16GiB-dev15")],
)
def test_concurrent_charging_stops_exactly_at_the_limit(
    tmp_path: Path, spawn: Callable[..., Tenant], device: int, limit: int
) -> None:
    write_region(tmp_path, one_gpu())
    tenants = [spawn("fill", device, limit, MIB) for _ in range(8)]
    for tenant in tenants:
        tenant.expect("ready")
    for tenant in tenants:  # all are waiting: release them together
        tenant.tell("go\n")
    totals = {tenant.pid: tenant.expect("done")[1] for tenant in tenants}
    assert sum(totals.values()) == limit
    assert sum(1 for total in totals.values() if total) >= 2, f"no race happened: {totals}"
    with TenantUsage(tmp_path) as region:
        assert region.device_used(device) == limit
        assert {lg.pid: lg.used[device] for lg in region.ledgers()} == totals


def test_a_region_dir_that_cannot_be_removed_is_an_error_not_a_success(tmp_path: Path) -> None:
    from cgpud.node.region import RegionError, remove_region_dir

    remove_region_dir(tmp_path / "gone")  # already gone: removed
    made = tmp_path / "made"
    made.mkdir()
    (made / "limits").write_bytes(b"x")
    remove_region_dir(made)
    assert not made.exists()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(RegionError, match=f"cannot remove instance region {not_a_dir}"):
        remove_region_dir(not_a_dir)
