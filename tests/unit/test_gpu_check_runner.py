"""bench/gpu_check's pure parts: how a check's outcome becomes its status,
the run's budget, the report's verdict, and the compute checks' rule."""

from __future__ import annotations

from bench.gpu_check import away, handover
from bench.gpu_check.compute import expected
from bench.gpu_check.handover import Busy
from bench.gpu_check.main import UsageError, parse_args
from bench.gpu_check.model import CheckError, CheckResult, Machine, Report, Skip, Status
from bench.gpu_check.runner import Runner

import pytest


def _raise(e: Exception) -> CheckResult:
    raise e


def test_skip_error_and_bug_become_skip_fail_fail_with_their_reason():
    r = Runner(60, frozenset())
    r.check("a.skip", "a", lambda: _raise(Skip("MIG: the GPU does not support MIG")))
    r.check("a.error", "a", lambda: _raise(CheckError("cgpud not ready within 60 s")))
    r.check("a.bug", "a", lambda: _raise(KeyError("uuid")))
    r.check("a.pass", "a", lambda: CheckResult("", "", Status.PASS, figure="1"))
    got = {c.name: (c.status, c.detail) for c in r.results}
    assert got == {
        "a.skip": (Status.SKIP, "MIG: the GPU does not support MIG"),
        "a.error": (Status.FAIL, "cgpud not ready within 60 s"),
        "a.bug": (Status.FAIL, "KeyError: 'uuid'"),
        "a.pass": (Status.PASS, ""),
    }
    assert [c.group for c in r.results] == ["a"] * 4


def test_a_check_past_the_budget_is_not_run_and_fails():
    r = Runner(0, frozenset())
    ran = []
    r.check("memory.driver", "memory", lambda: ran.append(1) or CheckResult("", "", Status.PASS))
    assert ran == [] and r.results[0].status is Status.FAIL and "budget" in r.results[0].detail


def test_only_selects_checks_and_groups_but_never_setup_or_safety():
    r = Runner(60, frozenset({"compute.fixed", "memory.vmm"}))
    assert r.wanted("compute.fixed.1ms") and r.wanted("memory.vmm")
    assert not r.wanted("compute.fair.1ms") and not r.wanted("memory.driver") and not r.wanted("compute.fixedx")
    assert r.wanted("setup.build") and r.wanted("safety.state")


def test_the_report_fails_when_one_check_failed():
    m = Machine("580", 13000, [], None, None, True)
    report = Report(m, [CheckResult("a", "g", Status.PASS), CheckResult("b", "g", Status.SKIP)])
    assert report.to_json()["passed"] is True and report.to_json()["checks"][1]["status"] == "SKIP"
    report.checks.append(CheckResult("c", "g", Status.FAIL, detail="x"))
    assert report.failed and report.to_json()["passed"] is False


@pytest.mark.parametrize(
    "policy, shares, ok",
    [
        ("fixed", [0.30, 0.70], True),
        ("fixed", [0.27, 0.62], True),  # a slow host: split 30/70, sum 89
        ("fixed", [0.50, 0.50], False),  # nobody enforced the share
        ("fixed", [0.15, 0.35], False),  # split right, the GPU idles half the time
        ("fair", [0.50, 0.49], True),
        ("fair", [0.30, 0.70], False),
        ("native", [0.50, 0.50], True),
        ("native", [0.30, 0.40], False),
    ],
)
def test_shares_pass_on_their_split_and_their_sum(policy, shares, ok):
    _, judge = expected(policy, 0.05, 0.85)
    assert judge(shares) is ok


@pytest.mark.parametrize("argv", [["--mem", "0"], ["--budget"], ["--bogus"], ["--hami", "/no/such/libvgpu.so"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(UsageError):
        parse_args(argv)


@pytest.mark.parametrize(
    "saturating, bursty, alone, busy",
    [(0.70, 0.29, 1.0, 0.99), (1.40, 0.56, 2.0, 0.98), (0.70, 0.0, 1.0, 0.70), (0.5, 0.5, 0.0, 0.0)],
)
def test_handover_busy_is_both_throughputs_over_the_saturating_alone(saturating, bursty, alone, busy):
    assert Busy(saturating, bursty, alone).fraction == pytest.approx(busy)


def test_every_burst_shape_runs_under_every_lending_policy_and_quick_covers_each_once():
    assert set(handover.names(False)) == {
        f"handover.{p}.{s}" for p in ("fair", "preemptive", "weighted") for s in handover.SYNCS
    }
    quick = handover.names(True)
    assert {n.split(".")[2] for n in quick} == set(handover.SYNCS)
    assert {n.split(".")[1] for n in quick} == {"fair", "preemptive", "weighted"}


@pytest.mark.parametrize(
    "shares, stalls, ok, why",
    [
        ([0.30, 0.69], [12.0, 9.0], True, ""),
        ([0.33, 0.66], [12.0, 9.0], True, ""),
        ([0.45, 0.52], [12.0, 9.0], False, "split 46.4/53.6 while cgpud was away"),  # failed open
        ([0.30, 0.69], [300.0, 9.0], False, "a launch waited 300 ms"),
        ([0.0, 0.0], [0.0, 0.0], False, "the tenants ran nothing"),
    ],
)
def test_away_holds_on_the_split_and_the_launch_bound(shares, stalls, ok, why):
    held, reason = away.judge(shares, stalls, 0.05)
    assert held is ok and reason.startswith(why)
