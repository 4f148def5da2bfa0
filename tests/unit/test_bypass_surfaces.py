"""Where the bypass watchdog's findings show: the admin API
(ListBypassEvents, Instance.violations), cgpuctl (list's VIOLATIONS column,
inspect -d ID, events) and the Prometheus counters. A real InstanceService
over a real SQLite store, the real gRPC server on a real unix socket, real
cgpuctl; the event ring is filled by hand, as the watchdog fills it (it is
data, not a component under test here)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog.testing
from prometheus_client.parser import text_string_to_metric_families

from cgpud.api.cgpu.v1 import local_pb2 as pb
from cgpud.api.server import NOT_WATCHING, LocalServer, serve
from cgpud.cli import main as cgpuctl
from cgpud.cli.client import LocalClient
from cgpud.node.bypass_model import BypassEvent, BypassEvents, EventAction, Violation, ViolationKind
from cgpud.daemon.metrics import serve_metrics
from cgpud.daemon.stats import DaemonStats
from cgpud.node.model import GIB, MIB, GpuCapacity, NodeMode, NodePolicy, Owner, OwnerKind, Request
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.errors import NotFoundError

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB), GpuCapacity(1, "GPU-bbbb", 16 * GIB))
T0 = 1795500000.0  # 2026-11-24T06:00:00Z


@dataclass
class Node:
    service: InstanceService
    events: BypassEvents
    socket: Path
    a: str  # an instance with memory and compute events
    b: str  # an instance with none

    def cgpuctl(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        # The server shares this process: its log lines are not cgpuctl's output.
        with structlog.testing.capture_logs():
            code = cgpuctl.main(["--socket", str(self.socket), "--wait", "0", *args])
        out, err = capsys.readouterr()
        return code, out, err


def memory_event(
    instance_id: str,
    at: float,
    action: EventAction = EventAction.REPORTED,
    killed: tuple[int, ...] = (),
    detail: str = "",
) -> BypassEvent:
    v = Violation(
        ViolationKind.MEMORY_OVER_LIMIT,
        0,
        instance_id,
        (4242, 4243),
        used_bytes=4 * GIB,
        limit_bytes=GIB,
        detail="holds 4096 MiB on GPU 0, limit 1024 MiB + 2 x 512 MiB slack",
    )
    return BypassEvent(at, v, action, killed, detail)


def fill(events: BypassEvents, a: str) -> None:
    events.add(memory_event(a, T0))
    events.add(
        BypassEvent(
            T0 + 1,
            Violation(
                ViolationKind.UNKNOWN_PROCESS,
                1,
                "",
                (777,),
                used_bytes=300 * MIB,
                detail="pid 777 (/usr/bin/rogue) belongs to no instance",
            ),
            EventAction.REPORTED,
        )
    )
    events.add(
        BypassEvent(
            T0 + 2,
            Violation(ViolationKind.COMPUTE_OVER_SHARE, 0, a, (4242,), measured_percent=91.5, allowed_percent=30.0),
            EventAction.REPORTED,
        )
    )
    events.add(memory_event(a, T0 + 3, EventAction.KILLED, killed=(4242, 4243)))
    events.add(memory_event(a, T0 + 4, EventAction.KILL_FAILED, detail="pid 4243 is gone"))


def node(
    tmp_path: Path, events: BypassEvents | None, watching: tuple[bool, str] | None, name: str = "cgpud.sock"
) -> tuple[Node, LocalServer]:
    svc = InstanceService(
        Store(tmp_path / "db" / "cgpud.db"),
        GPUS,
        NodePolicy(mode=NodeMode.CORE_MEM),
        tmp_path / "regions",
        "580.65.06",
        "boot-1",
    )
    a = svc.create(Request(Owner(OwnerKind.PROCESS, "tenant-a"), GIB, core_percent=30)).id
    b = svc.create(Request(Owner(OwnerKind.DEVICE, "train-b"), 2 * GIB, gpu_count=2)).id
    if events is not None:
        fill(events, a)
    sock = tmp_path / "run" / name
    server = serve(svc, sock, events=events, watching=None if watching is None else (lambda: watching))
    return Node(svc, events or BypassEvents(), sock, a, b), server


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[Node]:
    n, server = node(tmp_path, BypassEvents(), (True, ""))
    try:
        yield n
    finally:
        server.stop(None).wait(5)


@pytest.fixture
def unwatched(tmp_path: Path) -> Iterator[Node]:
    # What cgpud runs with bypass_interval = 0: the ring exists and stays empty.
    n, server = node(tmp_path, None, None)
    try:
        yield n
    finally:
        server.stop(None).wait(5)


# ---- the API ------------------------------------------------------------------------------


def test_the_api_gives_events_newest_last_as_recorded(watched: Node) -> None:
    with LocalClient(watched.socket) as client:
        listing = client.bypass_events()
        assert listing.watching and listing.watch_detail == ""
        # Every field survives the trip, the kill's failure detail included.
        assert list(listing.events) == watched.events.recent()
        assert [e.time for e in listing.events] == [T0 + i for i in range(5)]
        mine = client.bypass_events(watched.a)
        assert [e.violation.kind for e in mine.events] == [
            ViolationKind.MEMORY_OVER_LIMIT,
            ViolationKind.COMPUTE_OVER_SHARE,
            ViolationKind.MEMORY_OVER_LIMIT,
            ViolationKind.MEMORY_OVER_LIMIT,
        ]
        last_two = client.bypass_events(watched.a, limit=2).events
        assert [(e.action, e.killed, e.detail) for e in last_two] == [
            (EventAction.KILLED, (4242, 4243), ""),
            (EventAction.KILL_FAILED, (), "pid 4243 is gone"),
        ]
        assert client.bypass_events(watched.b).events == ()


def test_instances_carry_their_violation_count(watched: Node) -> None:
    with LocalClient(watched.socket) as client:
        counted = dict((i.id, n) for i, n in client.list_with_violations())
        assert counted == {watched.a: 4, watched.b: 0}  # the unknown process belongs to neither
        assert client.get_with_violations(watched.a)[1] == 4
        # Released instances keep their count (history), and their events.
        watched.service.release(watched.a)
        assert dict((i.id, n) for i, n in client.list_with_violations(include_released=True))[watched.a] == 4
        assert len(client.bypass_events(watched.a).events) == 4


def test_an_unknown_instance_is_not_found_with_the_services_message(watched: Node) -> None:
    with pytest.raises(NotFoundError) as direct:
        watched.service.get("cgpu-000000000000")
    with LocalClient(watched.socket) as client, pytest.raises(NotFoundError) as api:
        client.bypass_events("cgpu-000000000000")
    assert str(api.value) == str(direct.value)


def test_without_a_ring_the_api_says_the_watchdog_is_not_running(unwatched: Node) -> None:
    with LocalClient(unwatched.socket) as client:
        listing = client.bypass_events()
        assert (listing.events, listing.watching, listing.watch_detail) == ((), False, NOT_WATCHING)
        assert all(n == 0 for _, n in client.list_with_violations())
        with pytest.raises(NotFoundError):
            client.bypass_events("nope")


def test_old_clients_read_the_new_instance_message(watched: Node) -> None:
    # A client built before `violations` existed parses Instance with the
    # field unknown: it must still get every field it knows.
    with LocalClient(watched.socket) as client:
        raw = client._call(client._stub.InspectInstance, pb.InspectInstanceRequest(id=watched.a))
    wire = raw.SerializeToString()
    old = pb.Instance()
    old.ParseFromString(wire)
    old.ClearField("violations")
    assert old.id == watched.a and old.grants[0].memory_bytes == GIB and raw.violations == 4


# ---- cgpuctl ------------------------------------------------------------------------------


def test_list_shows_violations_in_the_table_and_json(watched: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = watched.cgpuctl(capsys, "list")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[-1] == "VIOLATIONS"
    by_id = {r.split()[0]: r.split()[-1] for r in rows}
    assert by_id == {watched.a: "4", watched.b: "0"}
    code, out, _ = watched.cgpuctl(capsys, "list", "--output", "json")
    assert code == 0
    assert {i["id"]: i["violations"] for i in json.loads(out)} == {watched.a: 4, watched.b: 0}
    code, out, _ = watched.cgpuctl(capsys, "inspect", "--output", "json")
    assert {i["id"]: i["violations"] for i in json.loads(out)["instances"]} == {watched.a: 4, watched.b: 0}


def test_inspect_d_id_shows_the_instance_and_its_events(watched: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = watched.cgpuctl(capsys, "inspect", "-d", watched.a)
    assert code == 0, err
    lines = out.splitlines()
    assert f"ID:          {watched.a}" in lines and "VIOLATIONS:  4" in lines
    assert "GRANTS:      gpu 0 GPU-aaaa 1024 MiB core 30%" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("TIME"))
    assert lines[header].split() == ["TIME", "KIND", "GPU", "PIDS", "USED/ALLOWED", "ACTION", "DETAIL"]
    rows = [line.split(None, 6) for line in lines[header + 1 :]]
    assert [r[:6] for r in rows] == [
        ["2026-11-24T06:00:00Z", "memory_over_limit", "0", "4242,4243", "4096/1024MiB", "reported"],
        ["2026-11-24T06:00:02Z", "compute_over_share", "0", "4242", "92/30%", "reported"],
        ["2026-11-24T06:00:03Z", "memory_over_limit", "0", "4242,4243", "4096/1024MiB", "killed:4242,4243"],
        ["2026-11-24T06:00:04Z", "memory_over_limit", "0", "4242,4243", "4096/1024MiB", "kill_failed"],
    ]
    assert rows[0][6].startswith("holds 4096 MiB") and rows[3][6] == "pid 4243 is gone"
    assert "watchdog is off" not in out

    code, out, _ = watched.cgpuctl(capsys, "inspect", "-d", watched.a, "--limit", "1", "--output", "json")
    doc = json.loads(out)
    assert doc["id"] == watched.a and doc["violations"] == 4 and doc["watching"] is True
    [event] = doc["events"]
    assert event == {
        "time": T0 + 4,
        "kind": "memory_over_limit",
        "instance_id": watched.a,
        "gpu": 0,
        "pids": [4242, 4243],
        "used_bytes": 4 * GIB,
        "limit_bytes": GIB,
        "measured_percent": 0.0,
        "allowed_percent": 0.0,
        "action": "kill_failed",
        "killed": [],
        "detail": "holds 4096 MiB on GPU 0, limit 1024 MiB + 2 x 512 MiB slack",
        "action_detail": "pid 4243 is gone",
    }

    code, out, _ = watched.cgpuctl(capsys, "inspect", "-d", watched.b)
    assert code == 0 and "VIOLATIONS:  0" in out and out.rstrip().endswith("no bypass events")
    # Plain -d still lists every instance.
    code, out, _ = watched.cgpuctl(capsys, "inspect", "-d")
    assert code == 0 and watched.a in out and watched.b in out and "TIME" not in out


def test_events_lists_everything_newest_last(watched: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = watched.cgpuctl(capsys, "events")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["TIME", "KIND", "INSTANCE", "GPU", "PIDS", "USED/ALLOWED", "ACTION", "DETAIL"]
    assert [r.split()[1] for r in rows] == [
        "memory_over_limit",
        "unknown_process",
        "compute_over_share",
        "memory_over_limit",
        "memory_over_limit",
    ]
    unknown = rows[1].split(None, 7)
    assert unknown[2:7] == ["-", "1", "777", "300/0MiB", "reported"]
    assert unknown[7] == "pid 777 (/usr/bin/rogue) belongs to no instance"

    code, out, _ = watched.cgpuctl(capsys, "events", "--instance", watched.a, "--limit", "2")
    assert [r.split()[2] for r in out.splitlines()[1:]] == [watched.a, watched.a]
    assert [r.split()[6] for r in out.splitlines()[1:]] == ["killed:4242,4243", "kill_failed"]

    code, out, _ = watched.cgpuctl(capsys, "events", "--output", "json")
    doc = json.loads(out)
    assert doc["watching"] is True and [e["kind"] for e in doc["events"]][1] == "unknown_process"
    assert doc["events"][1]["instance_id"] == "" and doc["events"][2]["measured_percent"] == 91.5


def test_events_say_plainly_when_the_watchdog_is_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Events from before the mode stopped isolating are still shown.
    n, server = node(tmp_path, BypassEvents(), (False, "mode share does not isolate"), "off.sock")
    try:
        code, out, _ = n.cgpuctl(capsys, "events")
        assert code == 0
        first, header, *rows = out.splitlines()
        assert first == "the bypass watchdog is off: mode share does not isolate"
        assert header.startswith("TIME") and len(rows) == 5
        code, out, _ = n.cgpuctl(capsys, "events", "--output", "json")
        assert json.loads(out)["watching"] is False and json.loads(out)["watch_detail"] == "mode share does not isolate"
    finally:
        server.stop(None).wait(5)


def test_events_without_a_ring_say_the_watchdog_is_not_running(
    unwatched: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = unwatched.cgpuctl(capsys, "events")
    assert code == 0
    assert out.splitlines() == [f"the bypass watchdog is off: {NOT_WATCHING}", "no bypass events"]
    code, out, _ = unwatched.cgpuctl(capsys, "inspect", "-d", unwatched.a)
    assert code == 0 and "VIOLATIONS:  0" in out and f"off: {NOT_WATCHING}" in out


def test_events_refusals_are_one_line(watched: Node, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = watched.cgpuctl(capsys, "events", "--instance", "cgpu-000000000000")
    assert code == 1 and out == ""
    assert err == "cgpuctl: no instance cgpu-000000000000\n"
    with pytest.raises(SystemExit) as exit_:
        watched.cgpuctl(capsys, "events", "--limit", "0")
    assert exit_.value.code == 2
    assert "out of range: give 1 to 1000 events" in capsys.readouterr().err


def test_the_installed_cgpuctl_lists_events(watched: Node) -> None:
    # The entry point a shell runs, in its own process.
    out = subprocess.run(
        [str(Path(sys.executable).parent / "cgpuctl"), "--socket", str(watched.socket), "events", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["events"]) == 5


# ---- metrics ------------------------------------------------------------------------------


def test_a_scrape_shows_the_bypass_counters(watched: Node) -> None:
    stats = DaemonStats()
    stats.timed("bypass", lambda: None)
    stats.timed("bypass", lambda: None)
    server = serve_metrics("127.0.0.1:0", watched.service, stats, "test", {}, events=watched.events)
    try:
        port = server.endpoint.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop()
    samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        [v] = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
        return v

    assert value("cgpu_bypass_events_total", kind="memory_over_limit", action="reported") == 1
    assert value("cgpu_bypass_events_total", kind="memory_over_limit", action="killed") == 1
    assert value("cgpu_bypass_events_total", kind="memory_over_limit", action="kill_failed") == 1
    assert value("cgpu_bypass_events_total", kind="unknown_process", action="reported") == 1
    assert value("cgpu_bypass_events_total", kind="compute_over_share", action="reported") == 1
    assert value("cgpu_bypass_processes_killed_total") == 2
    assert value("cgpu_bypass_duration_seconds_count") == 2
    # One series per instance, labelled like the other per-instance metrics.
    assert (
        value(
            "cgpu_instance_bypass_violations_total",
            instance_id=watched.a,
            owner_kind="process",
            owner="tenant-a",
            gpu="0",
            UUID="GPU-aaaa",
        )
        == 4
    )
    assert value("cgpu_instance_bypass_violations_total", instance_id=watched.b, gpu="0") == 0
    assert not [s for s in samples if s[0] == "cgpu_instance_bypass_violations_total" and s[1]["gpu"] == "1"]
