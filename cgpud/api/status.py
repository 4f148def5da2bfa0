"""cgpud.errors <-> gRPC status codes, in one table so that the server's
mapping and the client's inverse cannot disagree. The status message is the
error's own one-line text in both directions."""

from __future__ import annotations

from typing import Any, NoReturn

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


def abort_rpc(context: grpc.ServicerContext, log: Any, rpc: str, error: Exception, service: str) -> NoReturn:
    """End an RPC whose body raised: a CgpuError with its status and its
    one-line message, anything else (a bug) as INTERNAL, its traceback kept
    in the log and one line for the client. `service` names who failed."""
    if isinstance(error, CgpuError):
        code, message = status_for(error), str(error)
        # Refusals are the API working as intended: info, not error.
        (log.error if code is grpc.StatusCode.INTERNAL else log.info)(
            "rpc failed", rpc=rpc, code=code.name, error=message
        )
    else:
        log.error("rpc crashed", rpc=rpc, exc_info=error)
        code = grpc.StatusCode.INTERNAL
        message = f"internal error in {service} ({type(error).__name__}: {error}); see its log (journalctl -u cgpud)"
    context.abort(code, message)
    raise AssertionError("grpc.ServicerContext.abort returned")  # it always raises
