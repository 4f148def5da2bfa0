"""cgpud.errors <-> gRPC status codes, in one table so that the server's
mapping and the client's inverse cannot disagree. The status message is the
error's own one-line text in both directions."""
from __future__ import annotations

import grpc

from cgpud.errors import AdmissionError, CgpuError, NotFoundError, StateError, UsageError

# Most specific first: the server picks the first class the error is an
# instance of. Every other CgpuError (GpuQueryError, ...) is INTERNAL.
ERROR_STATUS: tuple[tuple[type[CgpuError], grpc.StatusCode], ...] = (
    (UsageError, grpc.StatusCode.INVALID_ARGUMENT),
    (AdmissionError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (StateError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(error: CgpuError) -> grpc.StatusCode:
    for cls, code in ERROR_STATUS:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, message: str) -> CgpuError:
    """The cgpud error a status stands for; a plain CgpuError for codes that
    name no class (INTERNAL, UNKNOWN, ...)."""
    for cls, mapped in ERROR_STATUS:
        if code == mapped:
            return cls(message)
    return CgpuError(message)
