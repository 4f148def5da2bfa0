"""The bypass watchdog in a real cgpud on the simulated GPU, briefly: a
`cgpuctl run --mem 1` tenant that drops libcgpu (`env -u LD_PRELOAD`) and
takes 3 GiB is reported (report mode) or killed (kill mode), and bad
bypass settings stop cgpud with one line. The full end-to-end cases (other
bypasses, runc, false positives, latency) are test_bypass_watchdog.py's."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.daemon import BIN, Daemon, running_daemon
from tests.harness.wait import until

INTERVAL = "0.2"


def bypass_lines(d: Daemon) -> list[dict[str, Any]]:
    out = []
    for line in d.log.read_text().splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            if obj.get("event") == "bypass":
                out.append(obj)
    return out


def wait_bypass(d: Daemon, timeout: float = 20) -> list[dict[str, Any]]:
    return until(
        lambda: bypass_lines(d),
        timeout=timeout,
        interval=0.05,
        what="a bypass event",
        explain=lambda: f"cgpud's log ends: {d.log.read_text()[-3000:]}",
    )


def bypass_tenant(d: Daemon, hold: int) -> subprocess.Popen[str]:
    """3 GiB inside a 1 GiB instance: the simulated driver linked as usual,
    libcgpu not preloaded. Its JSON line says what it got."""
    return d.start_cgpuctl(
        "run",
        "--mem",
        "1",
        "--",
        "env",
        "-u",
        "LD_PRELOAD",
        "cgpu-burn",
        "--alloc",
        "3GiB",
        "--require-alloc",
        "--hold",
        str(hold),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def events(d: Daemon) -> dict[str, Any]:
    got = d.cgpuctl("events", "--output", "json")
    assert got.returncode == 0, got.stderr
    return dict(json.loads(got.stdout))


def instance_ids(d: Daemon) -> list[str]:
    listed = d.cgpuctl("list", "--output", "json")
    assert listed.returncode == 0, listed.stderr
    return [i["id"] for i in json.loads(listed.stdout)]


def test_report_mode_names_the_instance_and_leaves_the_process(tmp_path: Path, sim_env: dict[str, str]):
    with running_daemon(tmp_path, sim_env, "--bypass-interval", INTERVAL) as d:
        tenant = bypass_tenant(d, hold=30)
        try:
            [event, *_] = wait_bypass(d)
            ids = instance_ids(d)
            listing = events(d)
            assert tenant.poll() is None  # reported, not killed
        finally:
            tenant.terminate()
            tenant.communicate(timeout=30)
    assert event["kind"] == "memory_over_limit" and event["action"] == "reported"
    assert ids == [event["instance"]] and event["gpu"] == 0
    assert event["used"] >= 3 << 30 and event["limit"] == 1 << 30 and len(event["pids"]) == 1
    assert len(bypass_lines(d)) == 1  # once, not every round (the next report is 60 s later)
    # the admin API hands out the daemon's own ring
    assert listing["watching"] and [(e["instance_id"], e["action"]) for e in listing["events"]] == [
        (event["instance"], "reported")
    ]


@pytest.mark.parametrize(
    "flags, watching, why",
    [
        (["--bypass-interval", "0"], False, "bypass_interval is 0"),
        (["--mode", "share"], False, "mode share does not isolate"),
        ([], True, ""),
    ],
)
def test_the_api_says_whether_the_watchdog_looks(
    tmp_path: Path, sim_env: dict[str, str], flags: list[str], watching: bool, why: str
):
    with running_daemon(tmp_path, sim_env, *flags) as d:
        listing = events(d)
    assert (listing["watching"], listing["watch_detail"]) == (watching, why)


def test_kill_mode_kills_the_tenant_within_rounds(tmp_path: Path, sim_env: dict[str, str]):
    with running_daemon(tmp_path, sim_env, "--bypass-interval", INTERVAL, "--bypass-action", "kill") as d:
        start = time.monotonic()
        tenant = bypass_tenant(d, hold=60)
        out, err = tenant.communicate(timeout=60)
        took = time.monotonic() - start
        events = bypass_lines(d)
    assert tenant.returncode == 128 + 9, (out, err)  # cgpuctl run: the child died of SIGKILL
    assert took < 30  # not the 60 s hold
    killed = [e for e in events if e["action"] == "killed"]
    assert killed and killed[0]["kind"] == "memory_over_limit" and killed[0]["killed"] == killed[0]["pids"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--bypass-interval", "0.05"], "bypass_interval must be 0 (off) or between 0.1 and 60 seconds"),
        (["--bypass-action", "stop"], "setting bypass_action = 'stop' is not valid (one of: report, kill)"),
        (["--bypass-memory-slack-mib", "-1"], "bypass_memory_slack_mib must be between 0 and 65536"),
        (["--bypass-memory-slack-processes", "0"], "bypass_memory_slack_processes must be between 1 and 1024"),
        (["--bypass-compute-window", "0.5"], "bypass_compute_window must be between 1 and 600 seconds"),
        (["--bypass-compute-excess-percent", "0"], "bypass_compute_excess_percent must be between 1 and 100"),
        (["--bypass-allow", "cgroup:/system.slice/dcgm* pid:1"], "pid:1"),
    ],
)
def test_bad_bypass_settings_stop_cgpud_with_one_line(
    tmp_path: Path, sim_env: dict[str, str], flags: list[str], message: str
):
    (tmp_path / "none.toml").write_text("")
    done = subprocess.run(
        [str(BIN / "cgpud"), "--config", str(tmp_path / "none.toml"), "--state-dir", str(tmp_path / "state"), *flags],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert message in done.stderr and done.stderr.startswith("cgpud: ") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "state").exists()  # refused before anything started
