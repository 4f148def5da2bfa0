"""Running test code on several threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(*targets: Callable[[], object], timeout: float | None = None) -> None:
    """Each target on its own thread, every one started before the first is
    joined (so they overlap), then all joined, each within `timeout`."""
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
