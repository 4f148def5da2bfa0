"""What cgpud shares with its C parts (libcgpu.so, cgpu-runtime, cgpu-hook),
read from the C headers through cffi so that each value is written once:
cgpu/region.h (where a container finds its region) and cgpu/relay_wire.h
(the relay protocol, which that header describes)."""

from __future__ import annotations

from cgpud._region import ffi, lib


def _text(value: object) -> str:
    return ffi.string(value).decode()


CONTAINER_REGION: str = _text(lib.CGPU_REGION_FIXED_DIR)  # the fixed place libcgpu.so looks for its region
REGION_ENV: str = _text(lib.CGPU_REGION_ENV)  # names the region directory instead (host processes)
ENV_PREFIX: str = _text(lib.CGPU_ENV_PREFIX)  # of every env name a spec asks for a GPU share with

RELAY_DEFAULT_SOCKET: str = _text(lib.CGPU_RELAY_DEFAULT_SOCKET)
RELAY_MAX_REQUEST: int = lib.CGPU_RELAY_MAX_REQUEST
RELAY_MSG_MAX: int = lib.CGPU_RELAY_MSG_MAX  # the answer line, "\n" included
RELAY_SHIM_BINDS: str = _text(lib.CGPU_RELAY_SHIM_BINDS)  # prepare's flags, in the order they come
RELAY_SPEC_FD: str = _text(lib.CGPU_RELAY_SPEC_FD)
RELAY_TIMEOUT_S: int = lib.CGPU_RELAY_TIMEOUT_S
RELAY_WAIT_S: int = lib.CGPU_RELAY_WAIT_S  # how long a relay waits for a cgpud that is down
RUNTIME_GPU_PROGRAM: str = _text(lib.CGPU_RUNTIME_GPU_PROGRAM)  # beside cgpu-runtime, which hands GPU starts to it
CONTAINER_ID_MAX: int = lib.CGPU_CONTAINER_ID_MAX
INSTANCE_ID_MAX: int = lib.CGPU_INSTANCE_ID_LEN - 1  # the region's char[] keeps its NUL
