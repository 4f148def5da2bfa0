"""What cgpu's commands write to stderr. structlog set-up shared by cgpud
and cgpuctl: JSON lines when stderr is not a terminal (journald, files),
readable key=value on a terminal. And a command's failure: one line."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from cgpud.errors import CgpuError


def run_command(prog: str, work: Callable[[], int], failed: int = 1) -> int:
    """`work`'s exit status; a CgpuError it raises is printed as the one
    line `prog: message`, and the status is `failed`."""
    try:
        return work()
    except CgpuError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return failed


def configure_logging(level: int = logging.INFO) -> None:
    # Imported here: structlog (and the asyncio it loads) is a sixth of a
    # cgpuctl verb's start-up, and most verbs never log.
    import structlog

    renderer = (
        structlog.dev.ConsoleRenderer(colors=False) if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
