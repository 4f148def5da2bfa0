"""A node's change counter: watchers (the Capacity API's WatchNode) wait on
it instead of polling, and tell by the revision what they missed.

`incarnation` is new for every process: a revision is only comparable
within one incarnation, since the counter starts again at 0 on restart."""

from __future__ import annotations

import threading
import time
import uuid


class Changes:
    """A revision that only grows, and a way to wait for the next one.
    Thread-safe; one per InstanceService."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self._revision = 0
        self._cond = threading.Condition()

    @property
    def revision(self) -> int:
        with self._cond:
            return self._revision

    def bump(self) -> int:
        """Something a node view shows changed: the new revision, every
        waiter woken."""
        with self._cond:
            self._revision += 1
            self._cond.notify_all()
            return self._revision

    def wait(self, after: int, timeout: float) -> int:
        """The revision once it is past `after`, or when `timeout` seconds
        have passed (then possibly still `after`); at once when already past.
        Bounded so a watcher can notice its client left."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while self._revision <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._revision
