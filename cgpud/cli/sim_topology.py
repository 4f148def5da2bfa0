"""The machine shapes `cgpuctl sim --topology` offers: where each simulated
GPU sits in the PCIe tree (switch, host bridge, CPU socket) and which GPUs
its NVLinks join, as the simulator's config keys (docs/simulated-gpu.md).

- dgx1: 8 V100 in DGX-1's hybrid cube-mesh: two fully linked quads, one or
  two links a pair, and GPU i joined to GPU i+4; pairs (0,1), (2,3), (4,5),
  (6,7) share a PCIe switch, each quad a host bridge and a socket (the
  links as NVIDIA's go-gpuallocator describes the machine in its tests).
- pcie4: 4 PCIe GPUs, no NVLink: two behind one switch on socket 0, two
  behind another on socket 1.
- hgx8: 8 H100 on an NVSwitch fabric (18 links each, every GPU reaches
  every other through it); pairs share a PCIe switch, 4 GPUs a socket.
- nvlink2x2: 4 PCIe GPUs in two NVLink-bridged pairs (two links each),
  GPUs 0-1 on socket 0 and 2-3 on socket 1, each on a root port of its own.
"""

from __future__ import annotations

from cgpud.errors import UsageError

# Per GPU: its config keys beyond name, memory and SMs.
TOPOLOGIES: dict[str, tuple[str, ...]] = {
    "dgx1": (
        "switch=0 bridge=0 socket=0 nvlink=1,2,3*2,4*2",
        "switch=0 bridge=0 socket=0 nvlink=0,2*2,3,5*2",
        "switch=1 bridge=0 socket=0 nvlink=0,1*2,3*2,6",
        "switch=1 bridge=0 socket=0 nvlink=0*2,1,2*2,7",
        "switch=2 bridge=1 socket=1 nvlink=0*2,5,6,7*2",
        "switch=2 bridge=1 socket=1 nvlink=1*2,4,6*2,7",
        "switch=3 bridge=1 socket=1 nvlink=2,4,5*2,7*2",
        "switch=3 bridge=1 socket=1 nvlink=3,4*2,5,6*2",
    ),
    "hgx8": tuple(f"switch={i // 2} bridge={i // 4} socket={i // 4} nvswitch=18" for i in range(8)),
    "pcie4": (
        "switch=0 bridge=0 socket=0",
        "switch=0 bridge=0 socket=0",
        "switch=1 bridge=1 socket=1",
        "switch=1 bridge=1 socket=1",
    ),
    "nvlink2x2": (
        "socket=0 nvlink=1*2",
        "socket=0 nvlink=0*2",
        "socket=1 nvlink=3*2",
        "socket=1 nvlink=2*2",
    ),
}


def placement(topology: str, gpus: int) -> tuple[str, ...]:
    """The config keys of each GPU of `topology`, which must have `gpus` GPUs."""
    try:
        shape = TOPOLOGIES[topology]
    except KeyError:
        raise UsageError(f"unknown --topology {topology!r}: use one of {', '.join(TOPOLOGIES)}") from None
    if len(shape) != gpus:
        raise UsageError(f"--topology {topology} has {len(shape)} GPUs: use --gpus {len(shape)}")
    return shape
