"""The watchdog's pure decision as tables: what NVML lists and whose each
process is, in; violations, out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cgpud.node.bypass_model import AllowRule, ComputeView, GpuProcess, ProcessIdentity, ViolationKind, WatchSettings
from cgpud.node.model import GIB, MIB, Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.node.bypass_policy import DEFAULT_ALLOW, allowed, decide, parse_allow
from cgpud.errors import UsageError

SLACK = 512 * MIB
MEM = ViolationKind.MEMORY_OVER_LIMIT
UNKNOWN = ViolationKind.UNKNOWN_PROCESS
COMPUTE = ViolationKind.COMPUTE_OVER_SHARE


def inst(
    iid: str, *grants: tuple[int, int, int], state: InstanceState = InstanceState.BOUND, enforced: bool = True
) -> Instance:
    return Instance(
        iid, Owner(OwnerKind.PROCESS, iid), tuple(Grant(g, f"GPU-{g}", m, c) for g, m, c in grants), state, enforced
    )


def who(pid: int, iid: str | None, exe: str = "/usr/bin/tenant", cgroup: str = "/user.slice") -> ProcessIdentity:
    return ProcessIdentity(pid, 1000 + pid, exe, cgroup, iid)


def settings(
    isolating: bool = True, allow: tuple[AllowRule, ...] = DEFAULT_ALLOW, excess: float = 20.0
) -> WatchSettings:
    return WatchSettings(SLACK, excess, allow, isolating)


A = inst("a", (0, 1 * GIB, 0))
B = inst("b", (0, 2 * GIB, 0))

# (name, instances, processes, identities, expected [(kind, instance, gpu, pids, used, limit)])
MEMORY_CASES = [
    ("at the limit plus one process's slack", [A], [GpuProcess(0, 10, GIB + SLACK)], [who(10, "a")], []),
    (
        "one byte over limit + slack",
        [A],
        [GpuProcess(0, 10, GIB + SLACK + 1)],
        [who(10, "a")],
        [(MEM, "a", 0, (10,), GIB + SLACK + 1, GIB)],
    ),
    (
        "two processes: slack counts twice",
        [A],
        [GpuProcess(0, 10, GIB), GpuProcess(0, 11, 2 * SLACK)],
        [who(10, "a"), who(11, "a")],
        [],
    ),
    (
        "limit + slack x n + 1",
        [A],
        [GpuProcess(0, 10, GIB), GpuProcess(0, 11, 2 * SLACK + 1)],
        [who(10, "a"), who(11, "a")],
        [(MEM, "a", 0, (10, 11), GIB + 2 * SLACK + 1, GIB)],
    ),
    (
        "the slack counts for four processes at most: four at limit + 4 slacks",
        [A],
        [GpuProcess(0, 10 + i, (GIB + 4 * SLACK) // 4) for i in range(4)],
        [who(10 + i, "a") for i in range(4)],
        [],
    ),
    (
        "eight forked processes get four slacks",
        [A],
        [GpuProcess(0, 10 + i, 500 * MIB) for i in range(8)],
        [who(10 + i, "a") for i in range(8)],
        [(MEM, "a", 0, tuple(range(10, 18)), 4000 * MIB, GIB)],
    ),
    (
        "used not available counts nothing",
        [A],
        [GpuProcess(0, 10, None), GpuProcess(0, 11, None)],
        [who(10, "a"), who(11, "a")],
        [],
    ),
    (
        "not available beside a known figure",
        [A],
        [GpuProcess(0, 10, None), GpuProcess(0, 11, GIB + 2 * SLACK + 1)],
        [who(10, "a"), who(11, "a")],
        [(MEM, "a", 0, (10, 11), GIB + 2 * SLACK + 1, GIB)],
    ),
    (
        "a GPU it has no grant on has limit 0",
        [A],
        [GpuProcess(1, 10, SLACK + 1)],
        [who(10, "a")],
        [(MEM, "a", 1, (10,), SLACK + 1, 0)],
    ),
    ("within the slack on a GPU without a grant", [A], [GpuProcess(1, 10, SLACK)], [who(10, "a")], []),
    (
        "two instances on one GPU are judged apart",
        [A, B],
        [GpuProcess(0, 10, 3 * GIB), GpuProcess(0, 20, 2 * GIB)],
        [who(10, "a"), who(20, "b")],
        [(MEM, "a", 0, (10,), 3 * GIB, GIB)],
    ),
    (
        "both over, sorted by instance",
        [B, A],
        [GpuProcess(0, 20, 5 * GIB), GpuProcess(0, 10, 3 * GIB)],
        [who(10, "a"), who(20, "b")],
        [(MEM, "a", 0, (10,), 3 * GIB, GIB), (MEM, "b", 0, (20,), 5 * GIB, 2 * GIB)],
    ),
    (
        "one process on two GPUs: each GPU on its own",
        [inst("m", (0, GIB, 0), (1, GIB, 0))],
        [GpuProcess(0, 10, GIB), GpuProcess(1, 10, 2 * GIB)],
        [who(10, "m")],
        [(MEM, "m", 1, (10,), 2 * GIB, GIB)],
    ),
    (
        "an instance that does not enforce (share mode) has no limit",
        [inst("s", (0, GIB, 0), enforced=False)],
        [GpuProcess(0, 10, 8 * GIB)],
        [who(10, "s")],
        [],
    ),
    (
        "a whole-GPU grant (memory 0) has no limit",
        [inst("w", (0, 0, 0))],
        [GpuProcess(0, 10, 8 * GIB)],
        [who(10, "w")],
        [],
    ),
]


@pytest.mark.parametrize("name,instances,processes,identities,expected", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_memory_rule(name, instances, processes, identities, expected):
    got = decide(instances, processes, {i.pid: i for i in identities}, [], settings())
    assert [(v.kind, v.instance_id, v.gpu_index, v.pids, v.used_bytes, v.limit_bytes) for v in got] == expected
    for v in got:
        assert "GiB" in v.detail or "MiB" in v.detail
        assert "\n" not in v.detail


PERSISTENCED = "/usr/bin/nvidia-persistenced"
# (name, settings, identity of pid 30 (None: vanished), expected pids reported)
UNKNOWN_CASES = [
    ("no instance, not allowed", settings(), who(30, None), [(30,)]),
    ("allowed by a default exe rule", settings(), who(30, None, exe=PERSISTENCED), []),
    ("default exe rule in another directory", settings(), who(30, None, exe="/opt/nv/bin/nv-hostengine"), []),
    ("default rule is on the name, not a prefix", settings(), who(30, None, exe="/tmp/Xorg-evil"), [(30,)]),
    (
        "allowed by a cgroup rule",
        settings(allow=parse_allow("cgroup:/system.slice/dcgm*")),
        who(30, None, cgroup="/system.slice/dcgm-exporter.service"),
        [],
    ),
    (
        "cgroup rule does not match another cgroup",
        settings(allow=parse_allow("cgroup:/system.slice/dcgm*")),
        who(30, None, cgroup="/user.slice/dcgm"),
        [(30,)],
    ),
    ("unreadable exe is never allowed", settings(allow=parse_allow("exe:*")), who(30, None, exe=""), [(30,)]),
    ("non-isolating node reports nothing", settings(isolating=False), who(30, None), []),
    ("vanished before it was identified", settings(), None, []),
    ("process of a released instance is unknown", settings(), who(30, "gone"), [(30,)]),
    ("process of an instance not in the list is unknown", settings(), who(30, "nowhere"), [(30,)]),
]


@pytest.mark.parametrize("name,cfg,identity,expected", UNKNOWN_CASES, ids=[c[0] for c in UNKNOWN_CASES])
def test_unknown_rule(name, cfg, identity, expected):
    released = inst("gone", (0, GIB, 0), state=InstanceState.RELEASED)
    identities = {30: identity} if identity is not None else {}
    got = decide([A, released], [GpuProcess(0, 30, 3 * MIB)], identities, [], cfg)
    assert [v.pids for v in got] == expected
    for v in got:
        assert (v.kind, v.instance_id, v.gpu_index, v.used_bytes) == (UNKNOWN, "", 0, 3 * MIB)
        assert v.key == ("unknown_process", "30", 0)
        assert "pid 30" in v.detail and "3 MiB" in v.detail


def test_unknown_process_with_used_not_available_is_still_reported():
    got = decide([], [GpuProcess(0, 30, None)], {30: who(30, None)}, [], settings())
    assert [(v.kind, v.pids, v.used_bytes) for v in got] == [(UNKNOWN, (30,), 0)]


F = inst("f", (0, GIB, 30))


def view(share: int = 30, caps: bool = True, engine: float | None = None, iid: str = "f") -> ComputeView:
    return ComputeView(iid, 0, share, caps, engine)


# (name, view, sm_percent of the instance's two processes, expected (measured, allowed) or None)
COMPUTE_CASES = [
    ("no samples: nothing measured", view(), (None, None), None),
    ("fixed within share + excess", view(), (25.0, 25.0), None),
    ("fixed over share + excess", view(), (40.0, 10.5), (50.5, 30.0)),
    ("one process without samples, the other over", view(), (None, 51.0), (51.0, 30.0)),
    ("soft: the engine charged more than the share, allowed raised", view(engine=60.0), (40.0, 35.0), None),
    ("soft: over even the engine's charge", view(engine=60.0), (50.0, 31.0), (81.0, 60.0)),
    ("engine below the share keeps the share", view(engine=10.0), (51.0, None), (51.0, 30.0)),
    ("policy does not cap", view(caps=False), (100.0, 100.0), None),
]


@pytest.mark.parametrize("name,cv,sm,expected", COMPUTE_CASES, ids=[c[0] for c in COMPUTE_CASES])
def test_compute_rule(name, cv, sm, expected):
    procs = [GpuProcess(0, 10, GIB // 2, sm[0]), GpuProcess(0, 11, GIB // 4, sm[1])]
    got = decide([F], procs, {10: who(10, "f"), 11: who(11, "f")}, [cv], settings())
    assert [(v.measured_percent, v.allowed_percent) for v in got] == ([expected] if expected else [])
    for v in got:
        assert (v.kind, v.instance_id, v.gpu_index, v.pids) == (COMPUTE, "f", 0, (10, 11))


def test_compute_ignores_other_instances_processes_and_other_gpus():
    other = inst("o", (0, GIB, 0), (1, GIB, 0))
    procs = [GpuProcess(0, 20, 0, 90.0), GpuProcess(1, 10, 0, 90.0), GpuProcess(0, 10, 0, 20.0)]
    got = decide([F, other], procs, {10: who(10, "f"), 20: who(20, "o")}, [view()], settings())
    # f's pid 10 on GPU 1 is a memory matter (within slack), not f's GPU-0 compute
    assert got == []


def test_all_rules_at_once_are_sorted_and_deterministic():
    procs = [GpuProcess(0, 30, MIB), GpuProcess(0, 10, 3 * GIB, 99.0), GpuProcess(0, 31, MIB)]
    ids = {10: who(10, "f"), 30: who(30, None), 31: who(31, None)}
    first = decide([F], procs, ids, [view()], settings())
    assert [(v.kind, v.pids) for v in first] == [(COMPUTE, (10,)), (MEM, (10,)), (UNKNOWN, (30,)), (UNKNOWN, (31,))]
    assert decide([F], list(reversed(procs)), ids, [view()], settings()) == first


@pytest.mark.parametrize(
    "text,rules",
    [
        ("", ()),
        ("  ", ()),
        ("exe:/usr/bin/nv-hostengine", (AllowRule("exe", "/usr/bin/nv-hostengine"),)),
        (
            "cgroup:/system.slice/dcgm*  exe:*/Xorg",
            (AllowRule("cgroup", "/system.slice/dcgm*"), AllowRule("exe", "*/Xorg")),
        ),
    ],
)
def test_parse_allow(text, rules):
    assert parse_allow(text) == rules


@pytest.mark.parametrize(
    "text,bad",
    [
        ("exe", "exe"),
        ("exe:", "exe:"),
        ("path:/usr/bin/x", "path:/usr/bin/x"),
        ("cgroup:/ok EXE:/usr/bin/x", "EXE:/usr/bin/x"),
        ("exe:nv-hostengine", "exe:nv-hostengine"),
    ],
)
def test_parse_allow_refuses_with_one_line_naming_the_entry(text, bad):
    with pytest.raises(UsageError) as e:
        parse_allow(text)
    message = str(e.value)
    assert repr(bad) in message and "cgroup:<glob>" in message and "exe:<glob>" in message
    assert "\n" not in message


def test_allowed_matches_exe_or_cgroup_only_by_its_own_field():
    rules = parse_allow("exe:/opt/a cgroup:/b/*")
    assert allowed(who(1, None, exe="/opt/a"), rules)
    assert allowed(who(1, None, cgroup="/b/c"), rules)
    assert not allowed(who(1, None, exe="/b/c", cgroup="/opt/a"), rules)
    assert not allowed(who(1, None, exe="/opt/a", cgroup="/b"), parse_allow("cgroup:/b/*"))


def test_an_exe_rule_never_allows_a_process_in_another_root():
    """A container's /proc/<pid>/exe is a path in its own image, which the
    tenant chooses: naming its binary Xorg must not make it allowed."""
    in_container = ProcessIdentity(7, 1007, "/usr/bin/Xorg", "/ct", None, host_root=False)
    assert allowed(replace(in_container, host_root=True), DEFAULT_ALLOW)
    assert not allowed(in_container, DEFAULT_ALLOW)
    assert allowed(in_container, parse_allow("cgroup:/ct"))  # the operator named its cgroup
