"""The machine as NVML shows it, through pynvml over whatever
libnvidia-ml.so.1 the loader finds: GPUs, memory in use, processes,
MIG and compute modes. Every call is short; NVML errors become CheckError."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pynvml as n

from bench.gpu_check.model import CheckError

T = TypeVar("T")


@contextmanager
def session() -> Iterator[None]:
    try:
        n.nvmlInit()
    except n.NVMLError as e:
        raise CheckError(f"NVML cannot start (is the NVIDIA driver loaded?): {e}") from e
    try:
        yield
    finally:
        n.nvmlShutdown()


def call(what: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        with session():
            return fn(*args)
    except n.NVMLError as e:
        raise CheckError(f"NVML {what}: {e}") from e


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def machine() -> dict[str, Any]:
    """Driver versions and every GPU's name, UUID, memory and modes."""

    def read() -> dict[str, Any]:
        gpus = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                {
                    "index": i,
                    "name": _text(n.nvmlDeviceGetName(h)),
                    "uuid": _text(n.nvmlDeviceGetUUID(h)),
                    "memory_total": int(n.nvmlDeviceGetMemoryInfo(h).total),
                    "mig_mode": mig_mode_of(h),
                    "compute_mode": int(n.nvmlDeviceGetComputeMode(h)),
                }
            )
        return {
            "driver_version": _text(n.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": int(n.nvmlSystemGetCudaDriverVersion()),
            "gpus": gpus,
            "nvidia_smi": shutil.which("nvidia-smi"),
            "runc": shutil.which("runc"),
        }

    return call("reading the machine", read)


def mig_mode_of(h: Any) -> int | None:
    """The current MIG mode, None where the GPU has no MIG."""
    try:
        current, _pending = n.nvmlDeviceGetMigMode(h)
        return int(current)
    except n.NVMLError_NotSupported:
        return None


def memory_used_all() -> list[int]:
    """Memory in use on every GPU, by index."""

    def read() -> list[int]:
        return [
            int(n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(i)).used) for i in range(n.nvmlDeviceGetCount())
        ]

    return call("memory in use", read)


def compute_mode(index: int) -> int:
    return call("compute mode", lambda: int(n.nvmlDeviceGetComputeMode(n.nvmlDeviceGetHandleByIndex(index))))


def set_compute_mode(index: int, mode: int) -> None:
    call("setting the compute mode", lambda: n.nvmlDeviceSetComputeMode(n.nvmlDeviceGetHandleByIndex(index), mode))
