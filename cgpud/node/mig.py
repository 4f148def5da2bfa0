"""MIG devices by the names NVIDIA's Kubernetes parts give them (pure)."""

from __future__ import annotations

import math

MIB = 1 << 20
GIB = 1 << 30
# NVML's MIG memory sizes are fractions of eighths of the GPU.
_MEMORY_EIGHTHS = 8


def mig_memory_gb(memory_mib: int, gpu_memory: int) -> int:
    """The "10gb" of "1g.10gb": the MIG device's share of the GPU's memory
    rounded up to eighths, times the GPU's memory in whole GB rounded up
    (NVIDIA's go-nvlib: 9984 MiB of an 80 GiB GPU is 10)."""
    if gpu_memory <= 0:
        return 0
    fraction = math.ceil(memory_mib * MIB / gpu_memory * _MEMORY_EIGHTHS) / _MEMORY_EIGHTHS
    total_gb = (gpu_memory + GIB - 1) // GIB
    return round(fraction * total_gb)


def mig_profile_name(gi_slices: int, ci_slices: int, memory_mib: int, gpu_memory: int) -> str:
    """ "3g.40gb"; "1c.3g.40gb" for a compute instance smaller than its GPU instance."""
    name = f"{gi_slices}g.{mig_memory_gb(memory_mib, gpu_memory)}gb"
    return name if ci_slices == gi_slices else f"{ci_slices}c.{name}"
