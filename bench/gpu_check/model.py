"""What a check reports: its status, the figure it measured, and why it was
skipped or failed. The JSON file is these dataclasses as they are
(docs/gpu-check.md, "The JSON file")."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class CheckResult:
    """One check: `name` is stable (the JSON's key for tools), `group` the
    promise it belongs to, `figure` the headline number as text, `expected`
    what it had to be, `detail` the reason (always for SKIP and FAIL), and
    `values` every measured number by name."""

    name: str
    group: str
    status: Status
    figure: str = ""
    expected: str = ""
    detail: str = ""
    seconds: float = 0.0
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Machine:
    """What the check ran on, as NVML and the CUDA driver report it."""

    driver_version: str
    cuda_driver_version: int
    gpus: list[dict[str, Any]]
    nvidia_smi: str | None
    runc: str | None
    root: bool


@dataclass
class Report:
    machine: Machine
    checks: list[CheckResult] = field(default_factory=list)
    quick: bool = False
    started: str = ""
    seconds: float = 0.0
    version: int = 1

    @property
    def failed(self) -> bool:
        return any(c.status is Status.FAIL for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["checks"] = [dict(asdict(c), status=c.status.value) for c in self.checks]
        out["passed"] = not self.failed
        return out


class CheckError(Exception):
    """A check could not run what it needed; the message says what failed.
    The runner reports it as that check's FAIL."""


class Skip(Exception):
    """A check cannot run on this machine; the message is the reason shown."""
