"""procmap over a fake /proc tree: hostile stat and cgroup contents, which
hierarchy names a container, the guards, ancestry, stickiness and reuse.
(tests/integration/test_procmap_real.py does the same with real processes,
cgroups and PID namespaces.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cgpud.node.model import GIB, Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.node.procmap import ProcessMapper, parse_cgroups, parse_stat, preferred_cgroup, read_cgroups, read_stat
from cgpud.node.procmap import BootClock, ProcStat, pid_alive, stat_alive, within
from tests.harness.procmap_instances import container_instance, owners, run_instance

BTIME = 1_000_000
TICKS = os.sysconf("SC_CLK_TCK")
SELF = 500
HYBRID = "9:name=systemd:{p}\n8:pids:{p}\n4:memory:/sandbox{p}\n2:cpu,cpuacct:{p}\n0::{u}\n"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        (root / "stat").write_text(f"cpu 1 2 3\nbtime {BTIME}\nprocesses 9\n")
        (root / "nsstore").mkdir()
        self.ns("host")
        self.add(SELF, 1, 10, "/", comm="cgpud")

    def ns(self, name: str) -> Path:
        path = self.root / "nsstore" / name
        if not path.exists():
            path.write_text(name)
        return path

    def add(
        self,
        pid: int,
        ppid: int,
        started: float,
        cgroup: str | None = None,
        unified: str | None = None,
        comm: str = "tenant",
        exe: str = "/usr/bin/tenant",
        ns: str = "host",
        raw_cgroup: str | None = None,
    ) -> None:
        """`started`: seconds after boot."""
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        ticks = int(started * TICKS)
        fields = ["S", str(ppid)] + ["0"] * 17 + [str(ticks)] + ["0"] * 10
        (d / "stat").write_bytes(f"{pid} ({comm}) ".encode() + " ".join(fields).encode() + b"\n")
        if raw_cgroup is None:
            path = cgroup or "/"
            raw_cgroup = HYBRID.format(p=path, u=unified if unified is not None else "/")
        (d / "cgroup").write_text(raw_cgroup)
        if (d / "exe").is_symlink():
            (d / "exe").unlink()
        (d / "exe").symlink_to(exe)
        (d / "ns").mkdir(exist_ok=True)
        if (d / "ns" / "pid").exists():
            (d / "ns" / "pid").unlink()
        os.link(self.ns(ns), d / "ns" / "pid")  # one inode per namespace, as nsfs gives

    def remove(self, pid: int) -> None:
        for f in ("stat", "cgroup", "exe", "ns/pid"):
            (self.root / str(pid) / f).unlink()


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def at(started: float) -> float:
    """Unix time of `started` seconds after boot."""
    return BTIME + started


@pytest.mark.parametrize("comm", ["a) b (c", "x)", ") 1 2 3 4 5", "new\nline", "(((", "16charsxxxxxxxxx"])
def test_stat_with_a_hostile_comm(proc, comm):
    proc.add(42, 7, 12.5, comm=comm)
    st = read_stat(42, proc.root)
    assert (st.pid, st.ppid, st.starttime) == (42, 7, int(12.5 * TICKS))


@pytest.mark.parametrize("text", [b"", b"42 (x) S", b"42 x S 1 2", b"42 (x) S notanumber" + b" 0" * 30])
def test_stat_garbage_is_none(text):
    assert parse_stat(42, text) is None


def test_huge_files_are_refused_not_read_whole(proc):
    proc.add(42, 1, 1)
    (proc.root / "42" / "stat").write_bytes(b"42 (" + b"x" * 100_000 + b") S 1" + b" 0" * 30)
    (proc.root / "42" / "cgroup").write_text("0::/" + "a" * 200_000 + "\n")
    assert read_stat(42, proc.root) is None
    assert read_cgroups(42, proc.root) is None


def test_a_vanished_process_reads_as_none(proc):
    assert read_stat(4242, proc.root) is None and read_cgroups(4242, proc.root) is None
    assert ProcessMapper(proc.root, SELF).identify([4242], []) == {}


@pytest.mark.parametrize(
    "text",
    [
        "8:pids:/a\n8:memory:/a\n",  # a hierarchy id twice
        "0::/x\n0::/victim\n",  # unified twice (a forged line)
        "8:pids\n",  # no path
        "x:pids:/a\n",  # no id
        "8:pids:relative\n",
    ],
)
def test_cgroup_text_that_is_not_one_line_per_hierarchy_is_refused(text):
    assert parse_cgroups(text.encode()) is None


def test_a_forged_line_is_refused_against_the_hierarchies_every_process_has(proc):
    # A cgroup named "x\n3:cpuset:/victim" on a hierarchy cgpud has, and
    # one naming a hierarchy that does not exist.
    own = (proc.root / str(SELF) / "cgroup").read_bytes()
    forged = own.decode().replace("8:pids:/\n", "8:pids:/x\n3:cpuset:/victim\n")
    proc.add(42, 1, 1, raw_cgroup=forged)
    assert read_cgroups(42, proc.root) is not None  # well formed on its own...
    assert read_cgroups(42, proc.root, tuple(parse_cgroups(own))) is None  # ...but one line too many
    proc.add(43, 1, 1, raw_cgroup=own.decode())
    assert read_cgroups(43, proc.root, tuple(parse_cgroups(own))) == parse_cgroups(own)


@pytest.mark.parametrize(
    "path,top,inside",
    [
        ("/a/b", "/a/b", True),
        ("/a/b/c", "/a/b", True),
        ("/a/bc", "/a/b", False),
        ("/a", "/a/b", False),
        ("/a/b/", "/a/b/", True),
    ],
)
def test_within(path, top, inside):
    assert within(path, top) is inside


@pytest.mark.parametrize(
    "text,expected",
    [
        (HYBRID.format(p="/ct", u="/"), ("pids", "/ct")),  # hybrid host, runc: v1 only
        (HYBRID.format(p="/ct", u="/ct-u"), ("", "/ct-u")),  # unified in use
        ("0::/system.slice/docker-1.scope\n", ("", "/system.slice/docker-1.scope")),  # pure v2
        ("0::/\n", ("", "/")),
        ("9:name=systemd:/s\n4:memory:/m\n", ("name=systemd", "/s")),
        ("4:memory:/m\n2:cpu,cpuacct:/c\n", ("memory", "/m")),
    ],
)
def test_preferred_cgroup(text, expected):
    assert preferred_cgroup(parse_cgroups(text.encode())) == expected


def test_container_by_cgroup_and_not_a_sibling_sharing_the_prefix(proc):
    proc.add(100, 1, 50, "/ct1")
    proc.add(101, 100, 51, "/ct1")
    proc.add(102, 1, 52, "/ct1/nested")  # not a descendant of the init: runc exec
    proc.add(103, 1, 53, "/ct10")
    proc.add(104, 1, 54, "/")
    got = owners(ProcessMapper(proc.root, SELF), [101, 102, 103, 104], [container_instance("c1", 100, at(50))])
    assert got == {101: "c1", 102: "c1", 103: None, 104: None}


def test_container_on_the_unified_hierarchy(proc):
    proc.add(100, 1, 50, "/", unified="/ct1")
    proc.add(101, 100, 51, "/", unified="/ct1/x")
    proc.add(102, 1, 51, "/", unified="/ct1x")
    got = owners(ProcessMapper(proc.root, SELF), [101, 102], [container_instance("c1", 100, at(50))])
    assert got == {101: "c1", 102: None}


def test_guard_init_in_cgpuds_own_cgroup_falls_back_to_the_pid_namespace(proc):
    proc.add(SELF, 1, 10, "/system.slice/cgpud.service")
    proc.add(100, 1, 50, "/system.slice/cgpud.service", ns="ct")
    proc.add(101, 1, 51, "/system.slice/cgpud.service", ns="ct")  # in the namespace, not the init's child
    proc.add(102, 100, 51, "/system.slice/cgpud.service")  # the init's child, in the host namespace (cannot be)
    proc.add(103, 1, 51, "/system.slice/cgpud.service")
    got = owners(ProcessMapper(proc.root, SELF), [101, 102, 103], [container_instance("c1", 100, at(50))])
    assert got == {101: "c1", 102: None, 103: None}


def test_guard_root_cgroup_and_host_namespace_fall_back_to_the_process_tree(proc):
    proc.add(100, 1, 50, "/")
    proc.add(101, 100, 51, "/")
    proc.add(102, 101, 52, "/")
    proc.add(103, 1, 53, "/")
    got = owners(ProcessMapper(proc.root, SELF), [102, 103], [container_instance("c1", 100, at(50))])
    assert got == {102: "c1", 103: None}


def test_cgpuctl_run_descendants_map_and_others_do_not(proc):
    proc.add(200, 1, 60, comm="cgpuctl")
    proc.add(201, 200, 61)
    proc.add(202, 201, 62)
    proc.add(203, 1, 62)
    proc.add(300, 1, 60, comm="cgpuctl")
    proc.add(301, 300, 61)
    instances = [run_instance("r1", (200, 201), at(61)), run_instance("r2", (300, 301), at(61))]
    got = owners(ProcessMapper(proc.root, SELF), [201, 202, 203, 301], instances)
    assert got == {201: "r1", 202: "r1", 203: None, 301: "r2"}


def test_a_reused_bound_pid_maps_nothing(proc):
    # cgpuctl (200) died; pid 200 now is a process started after the bind.
    proc.add(200, 1, 80)
    proc.add(201, 200, 81)
    got = owners(ProcessMapper(proc.root, SELF), [201], [run_instance("r1", (200,), at(61))])
    assert got == {201: None}
    # The same tree with the bound process itself (started before the bind + 1 s).
    proc.add(200, 1, 61.9)
    assert owners(ProcessMapper(proc.root, SELF), [201], [run_instance("r1", (200,), at(61))]) == {201: "r1"}


def test_a_dead_or_reused_container_init_maps_nothing(proc):
    proc.add(101, 1, 51, "/ct1")
    assert owners(ProcessMapper(proc.root, SELF), [101], [container_instance("c1", 100, at(50))]) == {101: None}
    proc.add(100, 1, 70, "/ct1")  # pid 100 again, but born after the bind
    assert owners(ProcessMapper(proc.root, SELF), [101], [container_instance("c1", 100, at(50))]) == {101: None}


def test_sticky_after_reparenting_and_forgotten_when_gone_or_released(proc):
    proc.add(200, 1, 60)
    proc.add(201, 200, 61)
    proc.add(202, 201, 62)
    inst = run_instance("r1", (200, 201), at(61))
    mapper = ProcessMapper(proc.root, SELF)
    assert owners(mapper, [202], [inst]) == {202: "r1"}
    proc.remove(201)
    proc.add(202, 1, 62)  # its parent exited: re-parented to init
    assert owners(mapper, [202], [inst]) == {202: "r1"}
    # A new process that took the pid is not the one seen.
    proc.add(202, 1, 90)
    assert owners(mapper, [202], [inst]) == {202: None}
    assert len(mapper) == 0
    # Released: every mapping of it goes.
    proc.add(202, 201, 62)
    proc.add(201, 200, 61)
    assert owners(mapper, [202], [inst]) == {202: "r1"} and len(mapper) == 1
    released = run_instance("r1", (200, 201), at(61), state=InstanceState.RELEASED)
    assert owners(mapper, [202], [released]) == {202: None}
    assert len(mapper) == 0


def test_sticky_map_forgets_a_process_that_left_the_gpu_and_died(proc):
    proc.add(200, 1, 60)
    proc.add(201, 200, 61)
    proc.add(202, 200, 61)
    inst = run_instance("r1", (200,), at(61))
    mapper = ProcessMapper(proc.root, SELF)
    owners(mapper, [201, 202], [inst])
    assert len(mapper) == 2
    owners(mapper, [202], [inst])  # 201 no longer on a GPU, still alive: kept
    assert len(mapper) == 2
    proc.remove(201)
    owners(mapper, [202], [inst])
    assert len(mapper) == 1


def test_sticky_map_is_bounded(proc):
    proc.add(200, 1, 60)
    for pid in range(201, 221):
        proc.add(pid, 200, 61)
    mapper = ProcessMapper(proc.root, SELF, cache_size=8)
    got = owners(mapper, list(range(201, 221)), [run_instance("r1", (200,), at(61))])
    assert set(got.values()) == {"r1"} and len(got) == 20
    assert len(mapper) == 8


def test_identity_fields(proc):
    proc.add(100, 1, 50, "/ct1", exe="/opt/app/bin/train")
    proc.add(101, 100, 51, "/ct1", exe="/opt/app/bin/train")
    (proc.root / "101" / "exe").unlink()  # unreadable exe
    got = ProcessMapper(proc.root, SELF).identify([100, 101], [container_instance("c1", 100, at(50))])
    assert got[100].exe == "/opt/app/bin/train" and got[100].cgroup == "/ct1"
    assert got[101].exe == "" and got[101].starttime == int(51 * TICKS) and got[101].instance_id == "c1"


def test_a_claimed_instance_handed_to_another_container_forgets_the_first_ones_processes(proc):
    proc.add(100, 1, 50, "/ct1")
    proc.add(101, 100, 51, "/ct1")
    proc.add(200, 1, 70, "/ct2")
    mapper = ProcessMapper(proc.root, SELF)

    def claimed(holder: str, init: int) -> Instance:
        return Instance(
            "d1",
            Owner(OwnerKind.DEVICE, "dev-1"),
            (Grant(0, "GPU-0", GIB, 0),),
            InstanceState.BOUND,
            True,
            pids=(init,),
            updated=at(80),
            holder=holder,
        )

    assert owners(mapper, [101], [claimed("a@/ba", 100)]) == {101: "d1"}
    assert owners(mapper, [101], [claimed("b@/bb", 200)]) == {101: None}
    assert len(mapper) == 0


def test_a_mapped_process_costs_one_stat_read_a_round(proc, monkeypatch):
    proc.add(200, 1, 60, comm="cgpuctl")
    proc.add(201, 200, 61)
    inst = run_instance("r1", (200,), at(61))
    mapper = ProcessMapper(proc.root, SELF)
    first = mapper.identify([201], [inst])
    opened: list[str] = []
    real_open = os.open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    again = mapper.identify([201], [inst])
    assert again == first and again[201].instance_id == "r1"
    # cgpud's own cgroup (the round's hierarchies), then 201's stat: not its
    # directory, cgroup or exe again
    assert opened == [f"{proc.root}/{SELF}/cgroup", f"{proc.root}/201/stat"]


def test_a_mapped_process_is_read_afresh_when_its_pid_is_reused_or_its_instance_rebound(proc):
    proc.add(200, 1, 60, comm="cgpuctl")
    proc.add(201, 200, 61, exe="/usr/bin/first")
    inst = run_instance("r1", (200,), at(61))
    mapper = ProcessMapper(proc.root, SELF)
    assert mapper.identify([201], [inst])[201].exe == "/usr/bin/first"
    proc.add(201, 1, 90, exe="/usr/bin/other")  # another process took the pid
    got = mapper.identify([201], [inst])[201]
    assert (got.exe, got.instance_id, got.starttime) == ("/usr/bin/other", None, int(90 * TICKS))
    proc.add(201, 200, 61, exe="/usr/bin/first")
    assert mapper.identify([201], [inst])[201].instance_id == "r1"
    released = run_instance("r1", (200,), at(61), state=InstanceState.RELEASED)
    assert mapper.identify([201], [released])[201].instance_id is None


@pytest.mark.parametrize(
    ("state", "started", "since", "alive"),
    [
        ("S", 60, at(61), True),
        ("R", 62.0, at(61), True),  # within the second of slack
        ("S", 62.5, at(61), False),  # born after the record: the pid was reused
        ("Z", 60, at(61), False),  # exited, not yet waited for
    ],
)
def test_pid_alive(proc, state, started, since, alive):
    proc.add(300, 1, started)
    stat = proc.root / "300" / "stat"
    stat.write_bytes(stat.read_bytes().replace(b") S ", f") {state} ".encode()))
    assert pid_alive(300, since, BootClock(proc.root)) is alive


def test_pid_alive_of_a_gone_or_hidden_process(proc):
    assert not pid_alive(4242, at(61), BootClock(proc.root))
    proc.add(300, 1, 60)
    (proc.root / "300" / "stat").write_bytes(b"300 (x) S 1 garbage")
    assert not pid_alive(300, at(61), BootClock(proc.root))


def test_pid_alive_of_a_process_it_may_not_read(proc):
    """Unreadable (hidepid, an LSM): alive, or a live instance would lose
    its memory. Root reads a mode-0 file, so the look is taken by a child
    that has dropped to nobody, as an unprivileged reader would."""
    proc.add(301, 1, 60)
    (proc.root / "301" / "stat").chmod(0)
    clock = BootClock(proc.root)
    child = os.fork()
    if child == 0:
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            os._exit(0 if pid_alive(301, at(61), clock) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_stat_alive_decision():
    st = ProcStat(1, 0, 100, "S")
    assert stat_alive(st, 10.0, 9.0) and not stat_alive(st, 10.5, 9.0)
    assert not stat_alive(None, None, 9.0) and not stat_alive(ProcStat(1, 0, 100, "Z"), 1.0, 9.0)
