"""The daemon's side of the instance region (csrc/include/cgpu/region.h):
writing the limits an instance may use, creating the shared usage file, and
reaping the ledgers of dead processes in it (a tenant's side of that file,
claiming and charging, lives in libcgpu.so; tests play it with
tests/harness/usage_tenant.py).

The layout, constants, checksum and checks all come from C through cffi
(cgpud._region), so this module never restates the binary format. File I/O
stays at the edges: the dataclasses are plain values, validated on creation.

Ownership: cgpud is the only writer of `limits` and the creator of `usage`;
tenant processes map `usage` and update it with C atomics. The usage file is
the tenant's own cooperative counter, never truth for cgpud: every read of it
is bounded (a fixed header, never the whole file), checked, and repaired in
place when it is damaged; a mapping of it is guarded against truncation
(csrc/region/guard.h). Each instance directory is a small tmpfs of its own
where cgpud may mount one, so a tenant that grows its usage file fills only
that. Thread-safety: a
UsageRegion may be shared by threads (reap is serialised on it);
InstanceLimits values are immutable."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from cgpud._region import ffi, lib
from cgpud.atomicfile import write_atomic
from cgpud.node.model import ComputePolicy
from cgpud.errors import CgpuError

LIMITS_FILE: str = ffi.string(lib.CGPU_LIMITS_FILE).decode()
USAGE_FILE: str = ffi.string(lib.CGPU_USAGE_FILE).decode()
GRANTS_FILE: str = ffi.string(lib.CGPU_GRANTS_FILE).decode()
MAX_DEVICES: int = lib.CGPU_MAX_DEVICES
MAX_PROCS: int = lib.CGPU_MAX_PROCS

DIR_MODE = 0o755  # it is the container's /run/cgpu; the instances directory above is 0700
INSTANCES_MODE = 0o700  # no host user but root reaches any region file
# In the instances directory: how cgpud holds regions (read by `cgpuctl doctor`).
REGION_FS_FILE = ".filesystem"
# Also there: the region made ahead of the next instance (make_spare_region).
# No instance id looks like it, so reconcile removes one a previous run left.
SPARE_REGION = ".spare"
LIMITS_MODE = 0o644  # read-only for everyone but cgpud; mounted read-only too
USAGE_MODE = 0o666  # a container process of any uid must update its ledger
GRANTS_MODE = 0o644  # only cgpud's scheduler opens or closes a gate

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_ERRLEN = 256
_HEADER = 16  # magic, version, size: the same first bytes in every region file
_PAGE = mmap.PAGESIZE
_LOG_LEVELS = range(lib.CGPU_LOG_QUIET, lib.CGPU_LOG_DEBUG + 1)


class RegionError(CgpuError):
    """An instance region could not be written or read, or a value for it is invalid."""


def _check_c_string(what: str, value: str, capacity: int) -> None:
    """The value must fit a NUL-terminated char[capacity] and mean the same in C."""
    if not value:
        raise RegionError(f"{what} is empty")
    if "\0" in value:
        raise RegionError(f"{what} {value!r} contains a NUL character")
    size = len(value.encode())
    if size >= capacity:
        raise RegionError(f"{what} {value!r} is {size} bytes; at most {capacity - 1} fit")


def _check_range(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise RegionError(f"{what} is {value}; it must be between {low} and {high}")


@dataclass(frozen=True)
class DeviceLimit:
    """What one instance may use of one GPU."""

    uuid: str  # "GPU-..." as NVML prints it: identity, never an index
    mem_limit: int  # bytes
    host_index: int  # NVML index on the host, for messages only
    core_percent: int = 0  # 1-100; 0 = no compute limit
    weight: int = 1
    priority: int = 0

    def __post_init__(self) -> None:
        _check_c_string("device UUID", self.uuid, lib.CGPU_UUID_LEN)
        _check_range(f"memory limit of {self.uuid}", self.mem_limit, 0, _U64_MAX)
        _check_range(f"host index of {self.uuid}", self.host_index, 0, _U32_MAX)
        _check_range(f"core percent of {self.uuid}", self.core_percent, 0, 100)
        _check_range(f"weight of {self.uuid}", self.weight, 0, _U32_MAX)
        _check_range(f"priority of {self.uuid}", self.priority, 0, _U32_MAX)


@dataclass(frozen=True)
class InstanceLimits:
    """Everything the `limits` file of one instance says."""

    instance_id: str
    devices: tuple[DeviceLimit, ...]
    log_level: int = lib.CGPU_LOG_QUIET
    compute_policy: int = ComputePolicy.NATIVE

    def __post_init__(self) -> None:
        # Accept any iterable but keep the value hashable and immutable.
        object.__setattr__(self, "devices", tuple(self.devices))
        _check_c_string("instance id", self.instance_id, lib.CGPU_INSTANCE_ID_LEN)
        if not 1 <= len(self.devices) <= MAX_DEVICES:
            raise RegionError(
                f"instance {self.instance_id} has {len(self.devices)} devices; 1 to {MAX_DEVICES} allowed"
            )
        uuids = [d.uuid for d in self.devices]
        duplicates = sorted({u for u in uuids if uuids.count(u) > 1})
        if duplicates:
            # Two entries for one GPU would give the instance two limits there.
            raise RegionError(f"instance {self.instance_id} names device {', '.join(duplicates)} more than once")
        _check_range(f"log level of instance {self.instance_id}", self.log_level, _LOG_LEVELS[0], _LOG_LEVELS[-1])
        _check_range(f"compute policy of instance {self.instance_id}", self.compute_policy, 0, _U32_MAX)


# ---------------------------------------------------------------- encoding


def _encode_limits(limits: InstanceLimits) -> bytes:
    raw = ffi.new("struct cgpu_limits *")  # zeroed: unused devices and padding checksum as zeros
    raw.magic = lib.CGPU_LIMITS_MAGIC
    raw.version = lib.CGPU_REGION_VERSION
    raw.size = ffi.sizeof("struct cgpu_limits")
    raw.instance_id = limits.instance_id.encode()
    raw.device_count = len(limits.devices)
    raw.log_level = limits.log_level
    raw.compute_policy = limits.compute_policy
    for slot, dev in zip(raw.device, limits.devices):
        slot.uuid = dev.uuid.encode()
        slot.mem_limit = dev.mem_limit
        slot.host_index = dev.host_index
        slot.core_percent = dev.core_percent
        slot.weight = dev.weight
        slot.priority = dev.priority
    raw.checksum = lib.cgpu_region_checksum(raw, ffi.offsetof("struct cgpu_limits", "checksum"))
    return bytes(ffi.buffer(raw))


def _decode_limits(raw: Any) -> InstanceLimits:
    def text(field: Any) -> str:
        return ffi.string(field).decode("utf-8", errors="replace")

    devices = tuple(
        DeviceLimit(
            uuid=text(d.uuid),
            mem_limit=d.mem_limit,
            host_index=d.host_index,
            core_percent=d.core_percent,
            weight=d.weight,
            priority=d.priority,
        )
        for d in raw.device[0 : raw.device_count]
    )
    return InstanceLimits(text(raw.instance_id), devices, raw.log_level, raw.compute_policy)


def _new_usage() -> bytes:
    raw = ffi.new("struct cgpu_usage *")  # zeroed: no usage, every ledger free
    raw.magic = lib.CGPU_USAGE_MAGIC
    raw.version = lib.CGPU_REGION_VERSION
    raw.size = ffi.sizeof("struct cgpu_usage")
    return bytes(ffi.buffer(raw))


_USAGE_HEADER = _new_usage()[:_HEADER]  # what every sound usage file starts with


def _new_grants(gated: bool, limits: InstanceLimits | None = None) -> bytes:
    # Gated: every gate closed, so an instance computes only once the
    # scheduler has it. Otherwise open for good. The live memory limits are
    # the limits file's until a resize.
    raw = ffi.new("struct cgpu_grants *")
    raw.magic = lib.CGPU_GRANTS_MAGIC
    raw.version = lib.CGPU_REGION_VERSION
    raw.size = ffi.sizeof("struct cgpu_grants")
    for d in range(MAX_DEVICES):
        raw.device[d].gate = 0 if gated else lib.CGPU_GATE_UNGATED
    for d, dev in enumerate(limits.devices if limits else ()):
        raw.device[d].mem_limit = dev.mem_limit
    return bytes(ffi.buffer(raw))


def _check_struct(check: Any, ctype: str, data: bytes) -> str | None:
    """Runs a C check over file contents; None if valid, else its message."""
    # The C check reads the header fields only when the file is big enough;
    # pad a short file so no read can pass the end of the buffer anyway.
    buf = ffi.new("char[]", max(len(data), ffi.sizeof(ctype)))
    ffi.memmove(buf, data, len(data))
    err = ffi.new("char[]", _ERRLEN)
    if check(ffi.cast(f"{ctype} *", buf), len(data), err, _ERRLEN) == 0:
        return None
    return ffi.string(err).decode()


# --------------------------------------------------------------- file I/O


def _open_regular(path: Path, flags: int) -> int:
    """Opens a regular file without following a final symlink: the usage file
    is writable by tenants, so cgpud must not be steered to another file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RegionError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_bounded(path: Path, size: int) -> tuple[bytes, int]:
    """At most `size` bytes from the start of the file, and its real size: a
    tenant decides how big its usage file is, so cgpud never reads it all."""
    fd = _open_regular(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, 0), os.fstat(fd).st_size
    finally:
        os.close(fd)


def _read_sized(path: Path, read: int, size: int) -> bytes | str:
    """The first `read` bytes of a region file that is exactly `size` bytes
    long, or why it cannot be kept."""
    try:
        data, file_size = _read_bounded(path, read)
    except FileNotFoundError:
        return "missing"
    except (OSError, RegionError) as e:
        return str(e)
    if file_size != size:
        return f"{path} is {file_size} bytes, not {size}"
    return data


def _file_problem(path: Path, check: Any, ctype: str) -> str | None:
    """Why an existing region file cannot be kept, or None if it can."""
    size = ffi.sizeof(ctype)
    data = _read_sized(path, size, size)
    return data if isinstance(data, str) else _check_struct(check, ctype, data)


def usage_problem(directory: Path) -> str | None:
    """Why the instance's usage file is unusable, or None if it is sound.
    Reads its size and its header only: the sweep asks this of every
    instance each round."""
    size = ffi.sizeof("struct cgpu_usage")
    head = _read_sized(Path(directory) / USAGE_FILE, _HEADER, size)
    if isinstance(head, str):
        return head
    if head == _USAGE_HEADER:
        return None
    return _check_struct(lib.cgpu_usage_check, "struct cgpu_usage", head + bytes(size - _HEADER))


def repair_usage(path: Path) -> str | None:
    """Puts a damaged usage file right in place, and says what was wrong
    (None: nothing). The size and the header are restored on the same inode,
    so processes that map it stay coherent with cgpud. A short file starts
    afresh: what the truncation threw away (its own processes' accounting)
    is gone, for that tenant only.
    Its pages are preallocated so no later write into them can fail."""
    size = ffi.sizeof("struct cgpu_usage")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        _create_usage(path)
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        os.unlink(path)
        _create_usage(path)
        return "not a regular file"
    fd = _open_regular(path, os.O_RDWR)
    try:
        wrong = []
        file_size = os.fstat(fd).st_size
        if file_size != size:
            os.ftruncate(fd, size)
            wrong.append(f"{file_size} bytes, not {size}")
        os.posix_fallocate(fd, 0, size)
        if file_size < size:
            # Ledgers were cut off: counters that no ledger explains would
            # hold the instance's memory for good. Start it afresh.
            os.pwrite(fd, _new_usage(), 0)
        elif os.pread(fd, _HEADER, 0) != _USAGE_HEADER:
            os.pwrite(fd, _USAGE_HEADER, 0)
            wrong.append("bad header")
        if stat.S_IMODE(os.fstat(fd).st_mode) != USAGE_MODE:
            os.fchmod(fd, USAGE_MODE)
        return ", ".join(wrong) or None
    finally:
        os.close(fd)


def _create_new(path: Path, data: bytes, mode: int, *, preallocate: bool = False) -> None:
    """A file that must not exist yet (O_EXCL, no link followed), written
    whole; `preallocate`: its pages too, so no later write into a mapping of
    it can fail."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not narrow it
        if preallocate:
            os.posix_fallocate(fd, 0, len(data))
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, f"short write to {path}")
    finally:
        os.close(fd)


def _create_usage(path: Path) -> None:
    write_atomic(path, _new_usage(), USAGE_MODE, durable=False)
    fd = _open_regular(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, ffi.sizeof("struct cgpu_usage"))
    finally:
        os.close(fd)


def region_fs_bytes() -> int:
    """What one instance's tmpfs holds: its three files, a temporary copy of
    each (write_atomic) and a few pages to spare."""
    pages = sum(-(-ffi.sizeof(c) // _PAGE) for c in ("struct cgpu_limits", "struct cgpu_usage", "struct cgpu_grants"))
    return (2 * pages + 4) * _PAGE


def make_region_dir(directory: Path, tmpfs: bool = True) -> str | None:
    """Creates an instance directory as its own size-capped tmpfs (with
    `tmpfs`). Returns None when it is one, else why not (the directory is
    then plain, on the state filesystem). An existing directory is left as
    it is: running processes may hold its files."""
    directory = Path(directory)
    parent = directory.parent
    try:
        parent_mode = os.stat(parent).st_mode  # on the start path: one call when all is in place
    except FileNotFoundError:
        parent.mkdir(mode=INSTANCES_MODE, parents=True, exist_ok=True)
        parent_mode = os.stat(parent).st_mode
    if stat.S_IMODE(parent_mode) != INSTANCES_MODE:
        os.chmod(parent, INSTANCES_MODE)
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        if directory.is_dir():
            return None if directory.is_mount() else "created before, as a plain directory"
        raise
    rc = lib.cgpu_region_mount(str(directory).encode(), region_fs_bytes()) if tmpfs else -errno.ENOTSUP
    os.chmod(directory, DIR_MODE)  # the tmpfs root, or mkdir's mode narrowed by the umask
    return None if rc == 0 else f"cannot mount a tmpfs at {directory}: {os.strerror(-rc)}"


def remove_region_dir(directory: Path) -> None:
    """Removes an instance directory, detaching its tmpfs first; one already
    gone is removed. Raises RegionError naming what is left behind."""
    directory = Path(directory)
    try:
        mounted = directory.is_mount()
    except OSError:
        mounted = False  # cannot even stat it: rmtree below says why
    rc = lib.cgpu_region_unmount(str(directory).encode()) if mounted else 0
    try:
        try:
            os.rmdir(directory)  # what the unmount leaves: the empty mount point
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EBUSY):
                raise
            shutil.rmtree(directory)  # a plain directory, or a tmpfs that would not unmount
    except FileNotFoundError:
        pass
    except OSError as e:
        detail = f" (unmount: {os.strerror(-rc)})" if rc else ""
        raise RegionError(f"cannot remove instance region {directory}: {e.strerror or e}{detail}") from e


def write_region(directory: Path, limits: InstanceLimits, gated: bool = False, *, fresh: bool = False) -> None:
    """Publishes `limits` for an instance and makes sure its usage and grants
    files exist.

    Valid usage and grants files are kept: processes already running keep
    their ledgers, counters and gates when the limits are rewritten. A missing or damaged one is
    replaced by an empty one (cgpud is the only creator, so checking and then
    replacing does not race with another writer).

    `fresh`: cgpud made `directory` empty a moment ago and nobody has seen it
    yet, so each file is created in place rather than renamed into it (a
    container start waits on this). A crash halfway leaves a short file,
    which reconcile's repair rewrites like any damaged one."""
    directory = Path(directory)
    if fresh:
        try:
            _create_new(directory / USAGE_FILE, _new_usage(), USAGE_MODE, preallocate=True)
            _create_new(directory / LIMITS_FILE, _encode_limits(limits), LIMITS_MODE)
            _create_new(directory / GRANTS_FILE, _new_grants(gated, limits), GRANTS_MODE)
        except OSError as e:
            raise RegionError(f"cannot write the region of instance {limits.instance_id} in {directory}: {e}") from e
        return
    try:
        if not directory.is_dir():
            directory.mkdir(mode=DIR_MODE, parents=True)
            os.chmod(directory, DIR_MODE)  # mkdir's mode is narrowed by the umask
        # Usage first: a tenant that filled its tmpfs must not make the
        # limits below fail to write.
        repair_usage(directory / USAGE_FILE)
        # Not durable: after a crash reconcile rebuilds a region from SQLite,
        # and a power loss ends every instance of that boot anyway.
        write_atomic(directory / LIMITS_FILE, _encode_limits(limits), LIMITS_MODE, durable=False)
        grants = directory / GRANTS_FILE
        if _file_problem(grants, lib.cgpu_grants_check, "struct cgpu_grants") is not None:
            write_atomic(grants, _new_grants(gated, limits), GRANTS_MODE, durable=False)
        else:  # processes may be reading it: in place
            with LiveLimits(directory, with_usage=False) as live:
                for slot, dev in enumerate(limits.devices):
                    live.store(slot, dev.mem_limit)
    except OSError as e:
        raise RegionError(f"cannot write the region of instance {limits.instance_id} in {directory}: {e}") from e


def make_spare_region(directory: Path, gated: bool, tmpfs: bool = True) -> str | None:
    """A region made ahead of the instance that will have it, off the start
    path: its own tmpfs (as make_region_dir, whose answer this is), a fresh
    usage file and grants file. claim_spare_region gives it an instance's
    name and limits. `directory` must not exist."""
    plain = make_region_dir(directory, tmpfs)
    try:
        _create_new(directory / USAGE_FILE, _new_usage(), USAGE_MODE, preallocate=True)
        _create_new(directory / GRANTS_FILE, _new_grants(gated), GRANTS_MODE)
    except OSError as e:
        raise RegionError(f"cannot make a spare region in {directory}: {e}") from e
    return plain


def claim_spare_region(spare: Path, directory: Path, limits: InstanceLimits, mounted: bool) -> bool:
    """Moves a spare region (make_spare_region; `mounted`: it is a tmpfs) to
    `directory`, which must not exist, and publishes `limits` in it: a
    mkdir, a move and one file, where a new region takes a mount and three
    files. False if the spare could not be moved, with nothing changed.
    Once moved, `spare` is an empty directory or gone."""
    try:
        os.mkdir(directory, DIR_MODE)
    except OSError:
        return False
    if mounted:
        moved = lib.cgpu_region_move(str(spare).encode(), str(directory).encode()) == 0
    else:
        moved = _rename_over(spare, directory)
    if not moved:
        os.rmdir(directory)
        return False
    try:
        _create_new(directory / LIMITS_FILE, _encode_limits(limits), LIMITS_MODE)
        # Nobody has opened the spare's grants file yet: plain writes do.
        fd = _open_regular(directory / GRANTS_FILE, os.O_WRONLY)
        try:
            for slot, dev in enumerate(limits.devices):
                os.pwrite(fd, dev.mem_limit.to_bytes(8, "little"), _live_limit_offset(slot))
        finally:
            os.close(fd)
    except OSError as e:
        raise RegionError(f"cannot write the region of instance {limits.instance_id} in {directory}: {e}") from e
    return True


def _rename_over(plain: Path, empty: Path) -> bool:
    # A plain spare (no tmpfs), renamed over the empty directory just made.
    try:
        os.rename(plain, empty)
    except OSError:
        return False
    return True


def grants_problem(directory: Path) -> str | None:
    """Why the instance's grants file is unusable, or None if it is sound."""
    return _file_problem(Path(directory) / GRANTS_FILE, lib.cgpu_grants_check, "struct cgpu_grants")


def read_limits(directory: Path) -> InstanceLimits:
    """The limits cgpud published in `directory`, checked as libcgpu.so checks them."""
    path = Path(directory) / LIMITS_FILE
    try:
        data, _ = _read_bounded(path, ffi.sizeof("struct cgpu_limits"))
    except OSError as e:
        raise RegionError(f"cannot read limits region {path}: {e.strerror}") from e
    problem = _check_struct(lib.cgpu_limits_check, "struct cgpu_limits", data)
    if problem is not None:
        raise RegionError(f"{path}: {problem}")
    raw = ffi.from_buffer("struct cgpu_limits *", data)
    try:
        return _decode_limits(raw)
    except RegionError as e:
        # The C check does not cover every field (log level, core percent...).
        raise RegionError(f"{path}: {e}") from e


# ------------------------------------------------------------ usage region


class UsageRegion(AbstractContextManager["UsageRegion"]):
    """The shared usage file of one instance, mapped read-write to reap the
    ledgers of dead processes.

    Ledger locks are OFD locks on this object's descriptor: two reaps on it
    at once could both take a dead ledger's lock (locks never conflict within
    one description) and return its usage twice, so reaps are serialised."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / USAGE_FILE
        self._lock = threading.Lock()  # reaps must be serialised (region_ops.h)
        size = ffi.sizeof("struct cgpu_usage")
        try:
            self._fd = _open_regular(self.path, os.O_RDWR)
        except OSError as e:
            raise RegionError(f"cannot open usage region {self.path}: {e.strerror}") from e
        try:
            file_size = os.fstat(self._fd).st_size
            if file_size != size:
                # Too short to map as the struct; let C word the complaint.
                problem = _check_struct(lib.cgpu_usage_check, "struct cgpu_usage", b"")
                raise RegionError(f"{self.path}: {problem} ({file_size} bytes)")
            self._map: mmap.mmap | None = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._u = ffi.from_buffer("struct cgpu_usage *", self._map, require_writable=True)
            # Before the first read: the tenant may truncate the file at any
            # moment, and cgpud must read zeros then, not die of SIGBUS.
            self._guard = int(lib.cgpu_guard_register(self._u, size))
            if self._guard < 0:
                raise RegionError(f"cannot guard usage region {self.path} against truncation: too many mapped")
            err = ffi.new("char[]", _ERRLEN)
            if lib.cgpu_usage_check(self._u, file_size, err, _ERRLEN) != 0:
                raise RegionError(f"{self.path}: {ffi.string(err).decode()}")
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _mapped(self) -> Any:
        if getattr(self, "_u", None) is None:
            raise RegionError(f"usage region {self.path} is closed")
        self._check_intact()
        return self._u

    def _check_intact(self) -> None:
        """Refuses a mapping whose file was resized or truncated under it:
        what it shows is no longer the tenant's counters."""
        if self.damaged:
            raise RegionError(f"usage region {self.path} was truncated while mapped")
        size = os.fstat(self._fd).st_size
        if size != ffi.sizeof("struct cgpu_usage"):
            raise RegionError(f"usage region {self.path} is {size} bytes now")

    @property
    def damaged(self) -> bool:
        """The file was truncated under the mapping (it reads zeros since)."""
        return getattr(self, "_guard", -1) >= 0 and bool(lib.cgpu_guard_damaged(self._guard))

    def reap(self) -> int:
        """Returns the usage of dead processes to the instance; how many were reaped."""
        with self._lock:
            reaped = int(lib.cgpu_ledger_reap(self._mapped(), self._fd, -1))
        self._check_intact()  # truncated meanwhile: the count means nothing
        return reaped

    def close(self) -> None:
        """Unmaps the file and closes it."""
        guard, self._guard = getattr(self, "_guard", -1), -1
        if guard >= 0:
            lib.cgpu_guard_unregister(guard)  # before the unmap: the range may be reused
        u, self._u = getattr(self, "_u", None), None
        if u is not None:
            ffi.release(u)  # the mmap cannot close while cffi exports it
        mapping, self._map = getattr(self, "_map", None), None
        if mapping is not None:
            mapping.close()
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)


# ------------------------------------------------------------ live limits


def _live_limit_offset(slot: int) -> int:
    return int(ffi.offsetof("struct cgpu_grants", "device", slot, "mem_limit"))


@dataclass(frozen=True)
class Shrink:
    """A device whose new limit is below what the instance holds there now."""

    slot: int
    used: int  # bytes


class LiveLimits(AbstractContextManager["LiveLimits"]):
    """An instance's live memory limits, in its grants file, where running
    processes read them at every allocation (region_ops.h:
    cgpu_grants_store_mem_limit). `with_usage`: each store also reads the
    device's usage, so a shrink below it can be undone."""

    def __init__(self, directory: Path, *, with_usage: bool = True) -> None:
        self.path = Path(directory) / GRANTS_FILE
        self._usage: UsageRegion | None = None
        size = ffi.sizeof("struct cgpu_grants")
        try:
            self._fd = _open_regular(self.path, os.O_RDWR)
        except OSError as e:
            raise RegionError(f"cannot open grants region {self.path}: {e.strerror}") from e
        try:
            if os.fstat(self._fd).st_size != size:
                raise RegionError(f"{self.path} is not a grants file of this version")
            # cgpud's own file (0644, read-only to the instance): nobody else can truncate it.
            self._map: mmap.mmap | None = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._g = ffi.from_buffer("struct cgpu_grants *", self._map, require_writable=True)
            if with_usage:
                self._usage = UsageRegion(Path(directory))
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def current(self, slot: int) -> int:
        return int(self._g.device[slot].mem_limit)

    def store(self, slot: int, limit: int) -> int:
        """Publishes `limit` for device `slot`; the device's usage right after
        (0 without usage)."""
        usage = self._usage._mapped() if self._usage is not None else ffi.NULL
        return int(lib.cgpu_grants_store_mem_limit(self._g, usage, slot, limit))

    def close(self) -> None:
        usage, self._usage = self._usage, None
        if usage is not None:
            usage.close()
        g, self._g = getattr(self, "_g", None), None
        if g is not None:
            ffi.release(g)
        mapping, self._map = getattr(self, "_map", None), None
        if mapping is not None:
            mapping.close()
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)


def resize_live_limits(directory: Path, limits: dict[int, int], *, check: bool = True) -> tuple[Shrink, ...]:
    """Sets the live memory limit of each device slot in `limits` (slot ->
    bytes). All or nothing: if a device's usage is above its new limit,
    every slot gets its old limit back and the shrinks that did not fit are
    returned; () when the new limits stand. `check=False`: set them whatever
    is held (putting back what stood a moment ago)."""
    with LiveLimits(directory, with_usage=check) as live:
        old = {slot: live.current(slot) for slot in limits}
        refused = tuple(
            Shrink(slot, used) for slot, limit in sorted(limits.items()) if (used := live.store(slot, limit)) > limit
        )
        if refused:
            for slot, limit in old.items():
                live.store(slot, limit)
        return refused
