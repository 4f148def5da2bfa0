"""The one exception hierarchy of cgpu: every failure a user can meet is a
CgpuError whose message says what was being done and what to fix."""

from __future__ import annotations


class CgpuError(Exception):
    """A failure with a message fit to print as one line."""


class UsageError(CgpuError):
    """A bad argument or setting; nothing was changed."""


class DaemonUnreachable(CgpuError):
    """cgpud could not be reached: down, restarting, or its socket refused us."""


class GpuQueryError(CgpuError):
    """The GPU driver (NVML) could not be queried."""


class AdmissionError(CgpuError):
    """The node cannot grant the request now (it does not fit)."""


class NotFoundError(CgpuError):
    """No such instance."""


class StateError(CgpuError):
    """The instance is not in a state that allows the operation."""
