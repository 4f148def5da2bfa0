"""Runs each check as a small function, times it, and turns what it raised
into its result: Skip is a SKIP with its reason, CheckError (or any other
error) a FAIL with its message. A check past the run's time budget is not
started and reported as a FAIL that says so."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import structlog

from bench.gpu_check.model import CheckError, CheckResult, Skip, Status

LOG = structlog.get_logger("gpu-check")
Check = Callable[[], CheckResult]


@dataclass
class Runner:
    budget_s: float
    only: frozenset[str]
    started: float = field(default_factory=time.monotonic)
    results: list[CheckResult] = field(default_factory=list)

    def wanted(self, name: str) -> bool:
        if name.startswith(("setup.", "safety.")):
            return True  # every run builds and checks it left the machine as found
        return not self.only or any(name == o or name.startswith(o + ".") for o in self.only)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def check(self, name: str, group: str, fn: Check) -> CheckResult | None:
        if not self.wanted(name):
            return None
        t0 = time.monotonic()
        if self.left() <= 0:
            result = CheckResult(
                name, group, Status.FAIL, detail=f"not run: the {self.budget_s:.0f} s budget was spent"
            )
        else:
            LOG.info("check", name=name)
            try:
                result = fn()
            except Skip as e:
                result = CheckResult(name, group, Status.SKIP, detail=str(e))
            except CheckError as e:
                result = CheckResult(name, group, Status.FAIL, detail=str(e))
            except Exception as e:  # a bug or an unexpected machine: that check fails, the others run
                LOG.exception("check raised", name=name)
                result = CheckResult(name, group, Status.FAIL, detail=f"{type(e).__name__}: {e}")
        result = replace(result, name=name, group=group, seconds=round(time.monotonic() - t0, 2))
        LOG.info("result", name=name, status=result.status.value, figure=result.figure, detail=result.detail)
        self.results.append(result)
        return result

    def skip(self, name: str, group: str, reason: str) -> None:
        self.check(name, group, lambda: CheckResult(name, group, Status.SKIP, detail=reason))

    def fail(self, name: str, group: str, reason: str) -> None:
        self.check(name, group, lambda: CheckResult(name, group, Status.FAIL, detail=reason))

    def fail_rest(self, names: tuple[str, ...], group: str, reason: str) -> None:
        """`names` that have no result yet FAIL with `reason` (their shared set-up failed)."""
        done = {r.name for r in self.results}
        for name in names:
            if name not in done:
                self.fail(name, group, reason)


def verdict(ok: bool) -> Status:
    return Status.PASS if ok else Status.FAIL
