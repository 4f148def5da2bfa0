"""procmap against real processes: real cgroups (made for the test and
removed after), real PID namespaces, real fork trees and real kills. The
test process plays cgpud (procmap compares with its own cgroup and PID
namespace)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.bypass_model import ProcessIdentity
from cgpud.node.model import InstanceState
from cgpud.node.procmap import ProcessMapper, kill_process, read_stat
from cgpud.node.bypass_policy import parse_allow
from tests.harness.procmap_instances import container_instance, owners, run_instance
from tests.harness.wait import until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make cgroups and PID namespaces")


def hierarchies() -> dict[str, Path]:
    """Where this host mounts the v1 pids hierarchy and the unified one."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split()[:3]
        mountpoint = Path(left.split()[4])
        if fstype == "cgroup2":
            out.setdefault("unified", mountpoint)
        elif fstype == "cgroup" and "pids" in options.split(","):
            out.setdefault("pids", mountpoint)
    return out


HIERARCHIES = hierarchies()


class Cgroups:
    """Cgroups under one test-owned directory of a hierarchy."""

    def __init__(self, mountpoint: Path) -> None:
        self.top = mountpoint / f"cgpu-procmap-{os.getpid()}"
        self.top.mkdir()

    def make(self, name: str) -> Path:
        path = self.top / name
        path.mkdir(parents=True)
        return path

    def move(self, pid: int, group: Path) -> None:
        (group / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for d in sorted((p for p in self.top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [self.top]:
            until(lambda: _rmdir(d), 5, interval=0.01, what=f"{d} to empty")


def _rmdir(d: Path) -> bool:
    try:
        d.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False  # exited tasks can linger a moment
    return True


class Procs:
    """Processes a test starts, each its own session so its whole tree dies."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def sleep(self, *prefix: str) -> subprocess.Popen[str]:
        return self.start([*prefix, "sleep", "300"])

    def start(self, argv: list[str], **kw: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, start_new_session=True, text=True, **kw)  # type: ignore[call-overload]
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.started:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    p.stop()


@pytest.fixture(params=sorted(HIERARCHIES))
def cgroups(request: pytest.FixtureRequest, procs: Procs) -> Iterator[Cgroups]:
    cg = Cgroups(HIERARCHIES[request.param])
    yield cg
    procs.stop()  # a cgroup with members cannot go
    cg.remove()


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def dead(pid: int) -> bool:
    """Gone, or exited and not yet reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def only_child(pid: int) -> int:
    return until(lambda: (children(pid) or [0])[0], 10.0, interval=0.01, what=f"the child of {pid}")


def test_container_processes_by_cgroup_not_a_sibling_sharing_the_prefix(cgroups: Cgroups, procs: Procs) -> None:
    ct, nested, sibling = cgroups.make("ct"), cgroups.make("ct/sub"), cgroups.make("ctx")
    init, execd, other, host = procs.sleep(), procs.sleep(), procs.sleep(), procs.sleep()
    cgroups.move(init.pid, ct)
    cgroups.move(execd.pid, nested)  # as `runc exec` puts it: in the container, not the init's child
    cgroups.move(other.pid, sibling)
    got = owners(ProcessMapper(), [init.pid, execd.pid, other.pid, host.pid], [container_instance("c1", init.pid)])
    assert got == {init.pid: "c1", execd.pid: "c1", other.pid: None, host.pid: None}
    ids = ProcessMapper().identify([execd.pid], [container_instance("c1", init.pid)])
    assert ids[execd.pid].cgroup.endswith(f"/cgpu-procmap-{os.getpid()}/ct/sub")
    assert ids[execd.pid].exe == os.path.realpath(shutil.which("sleep") or "")


def test_a_container_whose_init_died_maps_nothing(cgroups: Cgroups, procs: Procs) -> None:
    ct = cgroups.make("ct")
    init, member = procs.sleep(), procs.sleep()
    cgroups.move(init.pid, ct)
    cgroups.move(member.pid, ct)
    inst = container_instance("c1", init.pid)
    assert owners(ProcessMapper(), [member.pid], [inst]) == {member.pid: "c1"}
    os.kill(init.pid, signal.SIGKILL)
    init.wait()
    assert owners(ProcessMapper(), [member.pid], [inst]) == {member.pid: None}


TREE = textwrap.dedent("""
    import os, signal, sys, time
    c = os.fork()
    if c == 0:
        g = os.fork()
        if g == 0:
            time.sleep(300)
            os._exit(0)
        os.write(1, f"C {os.getpid()} {g}\\n".encode())
        signal.pause()
        os._exit(0)
    os.write(1, f"P {os.getpid()}\\n".encode())
    os.waitpid(c, 0)
    time.sleep(300)
""")


def fork_tree(procs: Procs) -> tuple[int, int, int]:
    """P (plays cgpuctl) -> C (the tenant it started) -> G (the tenant's child)."""
    proc = procs.start([sys.executable, "-c", TREE], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    lines = dict(proc.stdout.readline().split(None, 1) for _ in range(2))
    c, g = map(int, lines["C"].split())
    return int(lines["P"]), c, g


def test_cgpuctl_run_grandchild_maps_and_stays_mapped_after_its_parent_exits(procs: Procs) -> None:
    p, c, g = fork_tree(procs)
    stranger = procs.sleep().pid
    inst = run_instance("r1", (p, c))
    mapper = ProcessMapper()
    assert owners(mapper, [g, c, stranger], [inst]) == {g: "r1", c: "r1", stranger: None}
    os.kill(c, signal.SIGKILL)  # P reaps it; G is re-parented away from the tree
    until(lambda: (st := read_stat(g)) is not None and st.ppid != c, 10.0, interval=0.01, what="G re-parented")
    assert owners(ProcessMapper(), [g], [inst]) == {g: None}  # its ancestry no longer says
    assert owners(mapper, [g], [inst]) == {g: "r1"}  # but it was seen: sticky
    assert owners(mapper, [g], [run_instance("r1", (p, c), state=InstanceState.RELEASED)]) == {g: None}
    assert owners(mapper, [g], [inst]) == {g: None}  # released: forgotten for good


def test_a_reused_bound_pid_maps_nothing(procs: Procs) -> None:
    p, c, g = fork_tree(procs)
    # Bound an hour before these processes started: the pids were another's.
    inst = run_instance("r1", (p, c), updated=time.time() - 3600)
    assert owners(ProcessMapper(), [c, g], [inst]) == {c: None, g: None}


def test_kill_a_mapped_child_and_refuse_the_rest(procs: Procs) -> None:
    p, c, g = fork_tree(procs)
    other = procs.sleep()
    inst = run_instance("r1", (p, c))
    mapper = ProcessMapper()
    ids = mapper.identify([g, c, other.pid], [inst])

    # Refused: no instance, cgpud itself, its parent, pid 1, a stale start time, the allow list.
    own = ProcessIdentity(os.getpid(), read_stat(os.getpid()).starttime, "", "", "r1")
    parent = ProcessIdentity(os.getppid(), read_stat(os.getppid()).starttime, "", "", "r1")
    init = ProcessIdentity(1, 1, "", "", "r1")
    stale = ProcessIdentity(c, ids[c].starttime + 1, ids[c].exe, ids[c].cgroup, "r1")
    for identity, why in [
        (ids[other.pid], "no instance"),
        (own, "cgpud"),
        (parent, "cgpud"),
        (init, "pid 0 or 1"),
        (stale, "pid reused"),
    ]:
        ok, detail = kill_process(identity, mapper, [inst])
        assert not ok and why in detail, detail
    ok, detail = kill_process(ids[c], mapper, [inst], allow=parse_allow(f"exe:{ids[c].exe}"))
    assert not ok and "allow list" in detail
    # Refused: the instance is no longer active, so the process maps to none.
    ok, detail = kill_process(ids[c], mapper, [run_instance("r1", (p, c), state=InstanceState.RELEASED)])
    assert not ok and "no instance" in detail, detail
    assert all(read_stat(pid) is not None for pid in (c, g, other.pid))

    ok, detail = kill_process(ids[g], mapper, [inst])
    assert ok and "killed" in detail, detail
    until(lambda: dead(g), 10.0, interval=0.01, what="G dead")  # a zombie: C does not reap
    assert not dead(c) and not dead(p) and other.poll() is None  # only the one process


def test_with_kill_unknown_a_process_of_no_instance_is_killed_and_one_that_joined_an_instance_is_not(
    procs: Procs,
) -> None:
    """bypass_kill_unknown: the process of a container that got a GPU around
    cgpu. The re-check still holds: one that maps to an instance by now, the
    allow list, cgpud and pid 1 are refused."""
    stranger = procs.sleep()
    p, c, _ = fork_tree(procs)
    mapper = ProcessMapper()
    ids = mapper.identify([stranger.pid, c], [])
    assert ids[stranger.pid].instance_id is None and ids[c].instance_id is None
    own = ProcessIdentity(os.getpid(), read_stat(os.getpid()).starttime, "", "", None)
    ok, detail = kill_process(own, mapper, [], unknown=True)
    assert not ok and "cgpud" in detail, detail
    ok, detail = kill_process(
        ids[stranger.pid], mapper, [], allow=parse_allow(f"exe:{ids[stranger.pid].exe}"), unknown=True
    )
    assert not ok and "allow list" in detail, detail
    # c was of no instance when identified and is of one now: not this kill's to make
    ok, detail = kill_process(ids[c], mapper, [run_instance("r1", (p, c))], unknown=True)
    assert not ok and "now maps to r1" in detail, detail
    ok, detail = kill_process(ids[stranger.pid], mapper, [], unknown=True)
    assert ok and "killed" in detail, detail
    until(lambda: stranger.poll() is not None, 10.0, interval=0.01, what="the stranger dead")
    assert not dead(c)


def test_kill_of_a_process_that_already_exited_says_so(procs: Procs) -> None:
    # The tenant exited (a zombie its parent has not reaped): nothing to kill, and no error.
    parent = procs.start([sys.executable, "-c", "import os, time\nos.fork() or os._exit(0)\ntime.sleep(300)"])
    child = only_child(parent.pid)
    inst = run_instance("r1", (parent.pid,))
    mapper = ProcessMapper()
    identity = mapper.identify([child], [inst])[child]
    until(lambda: dead(child), 10.0, interval=0.01, what="the zombie")
    ok, detail = kill_process(identity, mapper, [inst])
    assert ok and "exited before the kill" in detail, detail


def test_pid_namespace_fallback_when_the_cgroup_is_cgpuds_own(procs: Procs) -> None:
    outer = procs.start(["unshare", "--pid", "--fork", "sleep", "300"])
    init = only_child(outer.pid)
    # In the container's namespace but no child of its init (as an exec), and
    # one in a namespace nested in it; beside a host process in the same cgroup.
    entered = procs.start(["nsenter", f"--target={init}", "--pid", "sleep", "300"])
    member = only_child(entered.pid)
    nest = procs.start(["nsenter", f"--target={init}", "--pid", "unshare", "--pid", "--fork", "sleep", "300"])
    nested = only_child(only_child(nest.pid))
    host = procs.sleep().pid
    assert Path(f"/proc/{member}/cgroup").read_text() == Path("/proc/self/cgroup").read_text()
    assert os.stat(f"/proc/{member}/ns/pid").st_ino == os.stat(f"/proc/{init}/ns/pid").st_ino
    got = owners(ProcessMapper(), [member, nested, host, entered.pid], [container_instance("c1", init)])
    assert got == {member: "c1", nested: "c1", host: None, entered.pid: None}


def test_process_tree_fallback_when_cgroup_and_namespace_are_cgpuds_own(procs: Procs) -> None:
    # `--pid=host` with no cgroup of its own: only the tree says.
    p, c, g = fork_tree(procs)
    stranger = procs.sleep().pid
    assert owners(ProcessMapper(), [c, g, stranger], [container_instance("c1", p)]) == {
        c: "c1",
        g: "c1",
        stranger: None,
    }


def test_identify_cost_for_24_processes(cgroups: Cgroups, procs: Procs) -> None:
    """12 processes of 3 containers (cgroups), 12 of 3 `cgpuctl run`s (trees)."""
    instances, expected = [], {}
    for n in range(3):
        group = cgroups.make(f"ct{n}")
        members = [procs.sleep() for _ in range(4)]
        for m in members:
            cgroups.move(m.pid, group)
        instances.append(container_instance(f"c{n}", members[0].pid))
        expected.update({m.pid: f"c{n}" for m in members})
    for n in range(3):
        script = "import os, time\nfor _ in range(4):\n    os.fork() or time.sleep(300)\ntime.sleep(300)"
        parent = procs.start([sys.executable, "-c", script])
        kids = until(
            lambda: len(children(parent.pid)) == 4 and children(parent.pid), 10.0, interval=0.01, what="4 children"
        )
        instances.append(run_instance(f"r{n}", (parent.pid,)))
        expected.update({k: f"r{n}" for k in kids})
    pids = sorted(expected)
    assert len(pids) == 24
    t0 = time.perf_counter()
    first = ProcessMapper().identify(pids, instances)
    cold = time.perf_counter() - t0
    mapper = ProcessMapper()
    mapper.identify(pids, instances)
    rounds = []
    for _ in range(30):
        t0 = time.perf_counter()
        got = mapper.identify(pids, instances)
        rounds.append(time.perf_counter() - t0)
    assert {p: i.instance_id for p, i in first.items()} == expected
    assert {p: i.instance_id for p, i in got.items()} == expected
    median = statistics.median(rounds)
    print(
        f"\nidentify() of 24 processes in 6 instances: first round {cold * 1e3:.2f} ms, "
        f"then median {median * 1e3:.2f} ms, worst {max(rounds) * 1e3:.2f} ms"
    )
    assert median < 0.02  # ~1 ms measured; 20x for a loaded 2-core machine


def test_kill_without_pidfd_rechecks_then_kills(procs: Procs, monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel before 5.3: pidfd_open fails with ENOSYS.
    def no_pidfd(pid: int) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    p, c, g = fork_tree(procs)
    inst = run_instance("r1", (p, c))
    mapper = ProcessMapper()
    ids = mapper.identify([g], [inst])
    stale = ProcessIdentity(g, ids[g].starttime - 1, ids[g].exe, ids[g].cgroup, "r1")
    ok, detail = kill_process(stale, mapper, [inst])
    assert not ok and "pid reused" in detail and not dead(g)
    ok, detail = kill_process(ids[g], mapper, [inst])
    assert ok and "no pidfd" in detail, detail
    until(lambda: dead(g), 10.0, interval=0.01, what="G dead")


def test_a_mapped_process_is_held_by_a_pidfd_and_read_no_more_while_it_lives(
    procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, c, g = fork_tree(procs)
    inst = run_instance("r1", (p, c))
    mapper = ProcessMapper()
    try:
        assert owners(mapper, [g, c], [inst]) == {g: "r1", c: "r1"}
        opened: list[str] = []
        real_open = os.open

        def counting_open(path: str, *args: object, **kwargs: object) -> int:
            opened.append(str(path))
            return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", counting_open)
        assert owners(mapper, [g, c], [inst]) == {g: "r1", c: "r1"}
        assert not [f for f in opened if f.startswith((f"/proc/{g}", f"/proc/{c}"))]
        monkeypatch.undo()
        os.kill(c, signal.SIGKILL)  # P reaps it
        until(lambda: read_stat(c) is None, 10.0, interval=0.01, what="C gone")
        assert owners(mapper, [g, c], [inst]) == {g: "r1"}  # C's pidfd said it exited: read afresh, gone
        assert len(mapper) == 1
    finally:
        mapper.close()
    assert owners(mapper, [g], [inst]) == {g: "r1"}  # without pidfds: by its stat
