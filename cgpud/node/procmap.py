"""Whose is a GPU process: what /proc says of it, the instance it maps to,
and a kill that cannot hit the wrong process.

A container's processes are those in its init's cgroup (or below it), on
whichever hierarchy says something; when the init's cgroup says nothing
(it is "/" or cgpud's own: rootless and odd runtimes), those in its PID
namespace (or one nested in it); when that is cgpud's own too, the init's
descendants. A `cgpuctl run` instance's processes are the descendants of
its bound pids. Bound pids are checked against reuse as pid_alive does:
started no later than the instance's last update (+1 s). A process once
mapped stays mapped for its life (pid and start time), so double-forking
away from its parent does not shed its instance.

Every read tolerates the process vanishing and hostile content: a comm
with ")" and spaces, cgroup names with newlines, huge files."""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cgpud.boundedread import read_at_most
from cgpud.node.bypass_model import AllowRule, ProcessIdentity
from cgpud.node.model import Instance
from cgpud.node.bypass_policy import allowed

PROC = Path("/proc")
_STAT_MAX = 4096  # a stat line is ~300 bytes; comm is at most 64
_CGROUP_MAX = 64 * 1024
_WALK_MAX = 256  # parent links followed before giving up (a loop or a pathological tree)
_NS_DEPTH = 32  # the kernel nests PID namespaces 32 deep at most
_NS_GET_PARENT = 0xB702  # ioctl on a namespace fd: its parent's fd
# Hierarchies whose paths name a container, best first, after the unified
# one ("" key, "0::" line) when that is not "/" (a hybrid host keeps it
# there, runc then only uses the v1 controllers).
_V1_KEYS = ("pids", "name=systemd", "memory")
DEFAULT_CACHE = 4096
PIDFDS = 256  # pidfds the mapper holds on processes it mapped (the rest: a stat read a round)


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    starttime: int  # clock ticks after boot (stat field 22)
    state: str = ""  # stat field 3: "R", "S", ... "Z" for a zombie


def _read(path: str, limit: int, dir_fd: int | None = None) -> bytes | None:
    """At most `limit` bytes; None if it cannot be read (the process is
    gone, or cgpud may not look) or is longer (not what the kernel writes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        data = read_at_most(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def parse_stat(pid: int, text: bytes) -> ProcStat | None:
    # comm is the tenant's to choose (any bytes but NUL, ")" and newlines
    # too): everything after the last ")" is the kernel's.
    close = text.rfind(b")")
    fields = text[close + 1 :].split() if close >= 0 else []
    try:
        return ProcStat(pid, int(fields[1]), int(fields[19]), fields[0].decode("ascii", "replace"))
    except (IndexError, ValueError):
        return None


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    text = _read(f"{proc}/{pid}/stat", _STAT_MAX)
    return parse_stat(pid, text) if text is not None else None


@dataclass
class BootClock:
    """Unix time a process started, as psutil computes it: boot time (read
    once from /proc/stat) plus its start in clock ticks."""

    proc: Path = PROC
    _btime: float | None = None
    _ticks: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK"))

    def created(self, st: ProcStat) -> float:
        if self._btime is None:
            self._btime = 0.0
            for line in (_read(f"{self.proc}/stat", 1 << 20) or b"").splitlines():
                if line.startswith(b"btime "):
                    self._btime = float(line.split()[1])
        return self._btime + st.starttime / self._ticks


def stat_alive(st: ProcStat | None, created: float | None, since: float) -> bool:
    """The decision of pid_alive (pure): a process exists (`st`), is no
    zombie (it has exited; only its parent has not waited) and started no
    later than `since` + 1 s (else another process took the pid)."""
    return st is not None and created is not None and created <= since + 1.0 and st.state != "Z"


def pid_alive(pid: int, since: float, clock: BootClock | None = None) -> bool:
    """The process exists and is the one recorded at `since`, not a reused
    pid. One read of /proc/PID/stat.

    A process cgpud may not inspect (proc mounted hidepid=1, an LSM) still
    exists: taking it for dead would release a live instance's memory. Its
    start time is unreadable, so a reused pid holds the instance until it
    exits."""
    clock = BootClock() if clock is None else clock
    try:
        fd = os.open(f"{clock.proc}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        return True
    except OSError:
        return False
    try:
        text = read_at_most(fd, _STAT_MAX)
    except PermissionError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    st = parse_stat(pid, text) if len(text) <= _STAT_MAX else None
    return stat_alive(st, clock.created(st) if st is not None else None, since)


def parse_cgroups(text: bytes) -> dict[str, str] | None:
    """Controllers ("" for the unified hierarchy, "cpu,cpuacct", "name=systemd")
    to path. None when the text is not one line per hierarchy: a cgroup
    name holding a newline would otherwise forge a line of its own."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    # Paths are bytes; \xNN for what is not UTF-8 keeps them printable and
    # encodable everywhere they go (logs, protobuf strings).
    for line in text.decode("utf-8", "backslashreplace").split("\n"):
        if not line:
            continue
        hid, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not sep1 or not sep2 or not hid.isdigit() or hid in seen or controllers in out or not path.startswith("/"):
            return None
        seen.add(hid)
        out[controllers] = path
    return out


def read_cgroups(pid: int, proc: Path = PROC, hierarchies: tuple[str, ...] | None = None) -> dict[str, str] | None:
    return checked_cgroups(_read(f"{proc}/{pid}/cgroup", _CGROUP_MAX), hierarchies)


def checked_cgroups(text: bytes | None, hierarchies: tuple[str, ...] | None) -> dict[str, str] | None:
    """parse_cgroups, and None unless the lines name `hierarchies` (the
    controllers of each line, in order: every process is in every
    hierarchy, so a line more is a forged one)."""
    cgroups = parse_cgroups(text) if text is not None else None
    if cgroups is not None and hierarchies is not None and tuple(cgroups) != hierarchies:
        return None
    return cgroups


@dataclass(frozen=True)
class ProcInfo:
    stat: ProcStat
    exe: str
    cgroup_text: bytes | None
    root: tuple[int, int] | None = None  # (device, inode) of its root directory; None: unreadable


def _file_id(path: str, dir_fd: int | None = None) -> tuple[int, int] | None:
    try:
        st = os.stat(path, dir_fd=dir_fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def read_process(pid: int, proc: Path = PROC) -> ProcInfo | None:
    """stat, exe and cgroup of one process, all of that very process: reads
    through a /proc/<pid> directory fd fail once it has exited, even if its
    pid is reused meanwhile."""
    try:
        d = os.open(f"{proc}/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = _read("stat", _STAT_MAX, d)
        st = parse_stat(pid, text) if text is not None else None
        if st is None:
            return None
        cgroup = _read("cgroup", _CGROUP_MAX, d)
        try:
            # The image chooses this name: bytes that are not UTF-8 must not
            # reach a protobuf string (it refuses them) as lone surrogates.
            exe = os.fsencode(os.readlink("exe", dir_fd=d)).decode("utf-8", "backslashreplace")
        except OSError:
            exe = ""
        return ProcInfo(st, exe, cgroup, _file_id("root", d))
    finally:
        os.close(d)


def read_pidns(pid: int, proc: Path = PROC) -> tuple[int, int] | None:
    """The PID namespace as (device, inode); None if unreadable."""
    try:
        st = os.stat(proc / str(pid) / "ns" / "pid")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _ns_chain(pid: int, proc: Path) -> list[tuple[int, int]]:
    """The process's PID namespace and its parents up to the one cgpud
    cannot see above (the kernel refuses with EPERM there)."""
    try:
        fd = os.open(proc / str(pid) / "ns" / "pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    chain = []
    try:
        for _ in range(_NS_DEPTH):
            st = os.fstat(fd)
            chain.append((st.st_dev, st.st_ino))
            try:
                parent = fcntl.ioctl(fd, _NS_GET_PARENT)
            except OSError:
                break
            os.close(fd)
            fd = parent
    finally:
        os.close(fd)
    return chain


def hierarchy_path(cgroups: Mapping[str, str], key: str) -> str | None:
    """The path on the hierarchy `key` names: "" is the unified one, else
    one controller (it may share its hierarchy: "cpu,cpuacct")."""
    if key in cgroups:
        return cgroups[key]
    for controllers, path in cgroups.items():
        if key and key in controllers.split(","):
            return path
    return None


def preferred_cgroup(cgroups: Mapping[str, str]) -> tuple[str, str]:
    """(key, path) of the hierarchy that best says where a process is."""
    unified = cgroups.get("")
    if unified is not None and unified != "/":
        return "", unified
    for key in _V1_KEYS:
        path = hierarchy_path(cgroups, key)
        if path is not None:
            return key, path
    return ("", unified) if unified is not None else ("", "")


def within(path: str, top: str) -> bool:
    """`path` is the cgroup `top` or below it ("/a/bc" is not below "/a/b")."""
    return path == top or path.startswith(top.rstrip("/") + "/")


@dataclass(frozen=True)
class _Anchor:
    """How one container instance recognises its processes this round."""

    instance_id: str
    how: str  # "cgroup" | "pidns" | "tree"
    key: str = ""  # cgroup: the hierarchy
    path: str = ""  # cgroup: the init's path there
    pidns: tuple[int, int] | None = None


class _Round:
    """What one identify() call reads once: the active instances, their
    live bound pids and anchors, and each /proc stat it needed."""

    def __init__(self, mapper: ProcessMapper, instances: Sequence[Instance]) -> None:
        self.m = mapper
        self.active = {i.id: i for i in instances if i.active}
        self.stats: dict[int, ProcStat | None] = {}
        own = read_cgroups(mapper.self_pid, mapper.proc)
        self.own_cgroups = own or {}
        # Every process is in every hierarchy: cgpud's own lines say which.
        self.hierarchies = tuple(own) if own else None
        self._bound: dict[tuple[int, int], str] | None = None  # (pid, starttime) -> instance, walked to
        self._anchors: list[_Anchor] | None = None

    def cgroups(self, pid: int) -> dict[str, str] | None:
        return read_cgroups(pid, self.m.proc, self.hierarchies)

    def binding(self, iid: str) -> tuple[str, int] | None:
        """Who the active instance is bound to (its container, its first
        pid); None when it is not active. A sticky mapping holds only while
        this stays: a claimed instance handed to another container starts afresh."""
        inst = self.active.get(iid)
        if inst is None:
            return None
        return (inst.holder, inst.pids[0] if inst.pids else 0)

    def stat(self, pid: int) -> ProcStat | None:
        if pid not in self.stats:
            self.stats[pid] = read_stat(pid, self.m.proc)
        return self.stats[pid]

    def _live_bound(self, inst: Instance, pid: int) -> ProcStat | None:
        """The bound process itself, not one that reused its pid."""
        st = self.stat(pid)
        if st is None or pid <= 1 or self.m.created(st) > inst.updated + 1.0:
            return None
        return st

    def _prepare(self) -> None:
        own_cg = self.own_cgroups
        own_ns = read_pidns(self.m.self_pid, self.m.proc)
        bound: dict[tuple[int, int], str] = {}
        anchors: list[_Anchor] = []
        for inst in self.active.values():
            if not inst.holder:
                for pid in inst.pids:
                    st = self._live_bound(inst, pid)
                    if st is not None:
                        bound[(pid, st.starttime)] = inst.id
                continue
            init = self._live_bound(inst, inst.pids[0]) if inst.pids else None
            if init is None:
                continue
            anchor = self._anchor(inst.id, init, own_cg, own_ns)
            anchors.append(anchor)
            if anchor.how == "tree":
                bound[(init.pid, init.starttime)] = inst.id
        self._bound, self._anchors = bound, anchors

    def _anchor(self, iid: str, init: ProcStat, own_cg: Mapping[str, str], own_ns: tuple[int, int] | None) -> _Anchor:
        cg = self.cgroups(init.pid)
        if cg:
            key, path = preferred_cgroup(cg)
            # "/" or cgpud's own cgroup holds far more than the container.
            if path and path != "/" and path != hierarchy_path(own_cg, key):
                return _Anchor(iid, "cgroup", key=key, path=path)
        ns = read_pidns(init.pid, self.m.proc)
        if ns is not None and ns != own_ns:
            return _Anchor(iid, "pidns", pidns=ns)
        return _Anchor(iid, "tree")

    def fresh(self, st: ProcStat, cgroups: Mapping[str, str] | None) -> str | None:
        """The instance the process maps to now, by the rules (no cache)."""
        if self._anchors is None or self._bound is None:
            self._prepare()
        assert self._anchors is not None and self._bound is not None
        # The nearest bound ancestor first: a `cgpuctl run` started inside a
        # container is that run's, not the container's.
        if self._bound:
            cur: ProcStat | None = st
            for _ in range(_WALK_MAX):
                if cur is None or cur.pid <= 1:
                    break
                iid = self._bound.get((cur.pid, cur.starttime))
                if iid is not None:
                    return iid
                cur = self.stat(cur.ppid)
        chain: list[tuple[int, int]] | None = None
        for a in self._anchors:
            if a.how == "cgroup":
                path = hierarchy_path(cgroups, a.key) if cgroups else None
                if path is not None and within(path, a.path):
                    return a.instance_id
            elif a.how == "pidns":
                if chain is None:
                    chain = _ns_chain(st.pid, self.m.proc)
                if a.pidns in chain:
                    return a.instance_id
        return None


class ProcessMapper:
    """Maps the pids NVML lists to instances, round after round. Holds the
    sticky map of processes once mapped (bounded); not thread-safe: one
    watchdog loop uses it."""

    def __init__(
        self, proc: Path = PROC, self_pid: int | None = None, cache_size: int = DEFAULT_CACHE, pidfds: int = PIDFDS
    ) -> None:
        self.proc = proc
        self.self_pid = os.getpid() if self_pid is None else self_pid
        self._cache_size = cache_size
        # (pid, starttime) -> (instance, its binding when the process was seen)
        self._sticky: dict[tuple[int, int], tuple[str, tuple[str, int]]] = {}
        # (pid, starttime) -> its identity when it was mapped; only for keys in _sticky
        self._known: dict[tuple[int, int], ProcessIdentity] = {}
        # (pid, starttime) -> a pidfd on that very process, for at most `pidfds`
        # keys of _known: while it is not readable the process lives, so its pid
        # is still its own and not even its stat needs reading. Only on the real
        # /proc (a fake tree's pids are not the host's).
        self._pidfd_max = pidfds if proc == PROC and hasattr(os, "pidfd_open") else 0
        self._pidfds: dict[tuple[int, int], int] = {}
        self._clock = BootClock(proc)
        self._root = _file_id(f"{proc}/{self.self_pid}/root")

    def host_root(self, info: ProcInfo) -> bool:
        """The process runs in cgpud's own root filesystem."""
        return info.root == self._root

    def created(self, st: ProcStat) -> float:
        """Unix time the process started, as psutil computes it (and so
        pid_alive): boot time plus its start in clock ticks."""
        return self._clock.created(st)

    def identify(self, pids: Iterable[int], instances: Sequence[Instance]) -> dict[int, ProcessIdentity]:
        """Each pid's identity; a pid whose process is gone is left out.
        instance_id None: it belongs to no active instance."""
        rnd = _Round(self, instances)
        out = {}
        wanted = sorted(set(pids))
        living = self._living(wanted)
        for pid in wanted:
            identity = self._identify(rnd, pid, living.get(pid))
            if identity is not None:
                out[pid] = identity
        self._prune(rnd, out)
        return out

    def _living(self, pids: Sequence[int]) -> dict[int, tuple[int, int]]:
        """pid -> key of the known processes among `pids` whose pidfd says
        they have not exited: one poll for all of them."""
        if not self._pidfds:
            return {}
        by_pid = {key[0]: (key, fd) for key, fd in self._pidfds.items()}
        mine = [by_pid[pid] for pid in pids if pid in by_pid]
        if not mine:
            return {}
        poller = select.poll()
        for _, fd in mine:
            poller.register(fd, select.POLLIN)
        exited = {fd for fd, _ in poller.poll(0)}
        return {key[0]: key for key, fd in mine if fd not in exited}

    def _pin(self, key: tuple[int, int]) -> None:
        """A pidfd on the known process `key`, if there is room and it is
        still that process once the pidfd is open."""
        if len(self._pidfds) >= self._pidfd_max or key in self._pidfds:
            return
        try:
            fd = os.pidfd_open(key[0])
        except OSError as e:
            if e.errno == errno.ENOSYS:
                self._pidfd_max = 0
            return
        st = read_stat(key[0], self.proc)  # the pid may have been reused before the pidfd was opened
        if st is None or st.starttime != key[1]:
            os.close(fd)
            return
        self._pidfds[key] = fd

    def close(self) -> None:
        """Lets go of the pidfds; the mapper still works, reading stats."""
        self._pidfd_max = 0
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    def instance_of(self, pid: int, instances: Sequence[Instance]) -> tuple[ProcStat | None, str | None]:
        """The process's stat as read now and the instance it maps to now
        (sticky map included), for a re-check before a kill."""
        rnd = _Round(self, instances)
        info = read_process(pid, self.proc)
        if info is None:
            return None, None
        rnd.stats[pid] = info.stat
        return info.stat, self._map(rnd, info.stat, checked_cgroups(info.cgroup_text, rnd.hierarchies))

    def protected(self) -> set[int]:
        """cgpud and its ancestors: never killed, whatever maps where."""
        out = {self.self_pid}
        st = read_stat(self.self_pid, self.proc)
        for _ in range(_WALK_MAX):
            if st is None or st.ppid <= 1:
                break
            out.add(st.ppid)
            st = read_stat(st.ppid, self.proc)
        return out

    def _map(self, rnd: _Round, st: ProcStat, cgroups: Mapping[str, str] | None) -> str | None:
        key = (st.pid, st.starttime)
        seen = self._sticky.get(key)
        if seen is not None and rnd.binding(seen[0]) == seen[1]:
            return seen[0]
        iid = rnd.fresh(st, cgroups)
        if iid is not None:
            self._remember(key, iid, rnd.binding(iid))
        return iid

    def _identify(self, rnd: _Round, pid: int, living: tuple[int, int] | None = None) -> ProcessIdentity | None:
        # A process already mapped to an instance that is still bound as it
        # was is that instance's for its life: its pidfd (it has not exited,
        # so the pid is still its own) or else its stat (the start time,
        # against pid reuse) is all it takes, not the four reads of a
        # process seen afresh. Its executable and cgroup, as first read,
        # decide nothing for a mapped process (the kill reads them again).
        if living is not None:
            key = living
        else:
            st = read_stat(pid, self.proc)
            if st is None:
                return None
            rnd.stats[pid] = st
            key = (pid, st.starttime)
        known, seen = self._known.get(key), self._sticky.get(key)
        if known is not None and seen is not None and rnd.binding(seen[0]) == seen[1]:
            return known
        info = read_process(pid, self.proc)
        if info is None:
            return None
        rnd.stats[pid] = st = info.stat
        cgroups = checked_cgroups(info.cgroup_text, rnd.hierarchies)
        iid = self._map(rnd, st, cgroups)
        identity = ProcessIdentity(
            pid, st.starttime, info.exe, preferred_cgroup(cgroups)[1] if cgroups else "", iid, self.host_root(info)
        )
        if iid is not None and (st.pid, st.starttime) in self._sticky:
            self._known[(st.pid, st.starttime)] = identity
            if self._pidfd_max:
                self._pin((st.pid, st.starttime))
        return identity

    def _remember(self, key: tuple[int, int], iid: str, binding: tuple[str, int] | None) -> None:
        if binding is None:
            return
        self._forget(key)
        while len(self._sticky) >= self._cache_size:
            self._forget(next(iter(self._sticky)))
        self._sticky[key] = (iid, binding)

    def _forget(self, key: tuple[int, int]) -> None:
        self._sticky.pop(key, None)
        self._known.pop(key, None)
        fd = self._pidfds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def _prune(self, rnd: _Round, seen: Mapping[int, ProcessIdentity]) -> None:
        """Forget processes that are gone and instances no longer active."""
        for key, (iid, binding) in list(self._sticky.items()):
            pid, start = key
            if rnd.binding(iid) != binding:
                self._forget(key)
            elif pid in seen:
                if seen[pid].starttime != start:
                    self._forget(key)
            else:
                st = rnd.stat(pid)
                if st is None or st.starttime != start:
                    self._forget(key)

    def __len__(self) -> int:
        return len(self._sticky)


def _exited(fd: int) -> bool:
    """A pidfd turns readable when its process exits."""
    return bool(select.select([fd], [], [], 0)[0])


def _recheck(
    identity: ProcessIdentity, mapper: ProcessMapper, instances: Sequence[Instance], allow: Sequence[AllowRule]
) -> tuple[bool, str] | None:
    """None when the process is still the one identified, of the same
    instance, and may be killed; else the answer to give instead."""
    pid = identity.pid
    st, iid = mapper.instance_of(pid, instances)
    if st is None:
        return True, f"pid {pid} had exited before the kill"
    if st.starttime != identity.starttime:
        return False, f"pid {pid} not killed: it is another process now (pid reused)"
    if iid != identity.instance_id:
        return False, f"pid {pid} not killed: it now maps to {iid or 'no instance'}, not {identity.instance_id}"
    info = read_process(pid, mapper.proc) if allow else None
    if info is not None and allowed(
        ProcessIdentity(pid, st.starttime, info.exe, identity.cgroup, iid, mapper.host_root(info)), allow
    ):
        return False, f"pid {pid} not killed: it is on the allow list"
    return None


def kill_process(
    identity: ProcessIdentity,
    mapper: ProcessMapper,
    instances: Sequence[Instance],
    allow: Sequence[AllowRule] = (),
    unknown: bool = False,
) -> tuple[bool, str]:
    """SIGKILL to one process of a violating instance, pinned by a pidfd and
    re-checked after pinning (same start time, same instance).

    (True, what happened) when the process is gone now: killed, or it had
    exited by itself. (False, why) when it was not killed: refused (pid <= 1,
    cgpud or an ancestor of it, no instance, allow-listed, reused, remapped)
    or the kill failed. Without pidfd_open (kernels before 5.3) the re-check
    and os.kill leave a window of microseconds in which the pid could be
    reused. `unknown`: a process of no instance may be killed (setting
    bypass_kill_unknown); the re-check then requires it still to be of none."""
    pid = identity.pid
    if pid <= 1:
        return False, f"pid {pid} not killed: never pid 0 or 1"
    if identity.instance_id is None and not unknown:
        return False, f"pid {pid} not killed: it belongs to no instance"
    if pid in mapper.protected():
        return False, f"pid {pid} not killed: it is cgpud or one of its ancestors"
    if allowed(identity, allow):
        return False, f"pid {pid} not killed: it is on the allow list"
    pidfd_open = getattr(os, "pidfd_open", None)
    try:
        if pidfd_open is None:
            raise OSError(errno.ENOSYS, "no pidfd_open")
        fd = pidfd_open(pid)
    except ProcessLookupError:
        return True, f"pid {pid} had exited before the kill"
    except OSError as e:
        if e.errno != errno.ENOSYS:
            return False, f"pid {pid} not killed: pidfd_open: {e.strerror}"
        return _kill_unpinned(identity, mapper, instances, allow)
    try:
        refused = _recheck(identity, mapper, instances, allow)
        if refused is not None:
            return refused
        # Not yet exited, so the /proc reads above were of this very process.
        if _exited(fd):
            return True, f"pid {pid} had exited before the kill"
        return _send_kill(pid, lambda: signal.pidfd_send_signal(fd, signal.SIGKILL), "pidfd_send_signal", "")
    finally:
        os.close(fd)


def _kill_unpinned(
    identity: ProcessIdentity, mapper: ProcessMapper, instances: Sequence[Instance], allow: Sequence[AllowRule]
) -> tuple[bool, str]:
    pid = identity.pid
    refused = _recheck(identity, mapper, instances, allow)
    if refused is not None:
        return refused
    return _send_kill(pid, lambda: os.kill(pid, signal.SIGKILL), "kill", ", no pidfd on this kernel")


def _send_kill(pid: int, send: Callable[[], None], call: str, note: str) -> tuple[bool, str]:
    try:
        send()
    except ProcessLookupError:
        return True, f"pid {pid} had exited before the kill"
    except OSError as e:
        return False, f"pid {pid} not killed: {call}: {e.strerror}"
    return True, f"pid {pid} killed (SIGKILL{note})"
