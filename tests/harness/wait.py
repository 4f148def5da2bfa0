"""The one poll: wait, bounded, until a predicate holds (rule 3: no wait
without a bound). A timeout fails the test naming what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A wait ran out; an AssertionError so that pytest reports it as the
    failed expectation it is."""


def until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "",
    explain: Callable[[], str] | None = None,
) -> T:
    """Calls predicate every `interval` s until it returns something truthy,
    and returns that; after `timeout` s raises WaitTimeout naming `what`
    (or the predicate) and, if given, explain()'s account of the state."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f": {explain()}" if explain is not None else ""
            raise WaitTimeout(
                f"timed out after {timeout:g} s waiting for {what or getattr(predicate, '__name__', predicate)}{detail}"
            )
        time.sleep(interval)
