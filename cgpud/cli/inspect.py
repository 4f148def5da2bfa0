"""`cgpuctl inspect` and `cgpuctl list`: the tables ACK users know from
`kubectl inspect cgpu`, for this node. Pure formatting of what the daemon
reports; memory in whole GiB as ACK shows it (totals rounded down, so a
16 GB card shows 15; allocations rounded up, never under-reported)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cgpud.daemon.model import GIB, Instance, NodeInfo

RULE = "-" * 78


def _gib_down(n: int) -> int:
    return n // GIB


def _gib_up(n: int) -> int:
    return -(-n // GIB)


def _table(rows: Sequence[Sequence[str]], wide_first: int = 0) -> list[str]:
    """Left-aligned columns two spaces apart; the first `wide_first`
    columns four apart, as kubectl-inspect-cgpu lays out NAME and IPADDRESS."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [cell.ljust(widths[c] + (4 if c < wide_first else 2)) for c, cell in enumerate(r)]
        lines.append("".join(cells).rstrip())
    return lines


def _totals(info: NodeInfo) -> tuple[int, int]:
    allocated = sum(_gib_up(g.allocated) for g in info.gpus)
    total = sum(_gib_down(g.gpu.memory) for g in info.gpus)
    return allocated, total


def _percent(part: int, whole: int) -> int:
    return round(100 * part / whole) if whole else 0


def inspect_summary(info: NodeInfo) -> str:
    header = ["NAME", "IPADDRESS", *[f"GPU{g.gpu.index}(Allocated/Total)" for g in info.gpus], "GPU Memory(GiB)"]
    allocated, total = _totals(info)
    row = [info.hostname, info.address or "-",
           *[f"{_gib_up(g.allocated)}/{_gib_down(g.gpu.memory)}" for g in info.gpus], f"{allocated}/{total}"]
    lines = _table([header, row], wide_first=2)
    lines += [RULE, "Allocated/Total GPU Memory In Cluster:", f"{allocated}/{total} ({_percent(allocated, total)}%)"]
    return "\n".join(lines) + "\n"


def inspect_details(info: NodeInfo, instances: Sequence[Instance]) -> str:
    allocated, total = _totals(info)
    header = ["NAME", "OWNER", *[f"GPU{g.gpu.index}(Allocated)" for g in info.gpus], "CORE(%)"]
    rows = [header]
    for inst in instances:
        by_gpu = {g.gpu_index: g for g in inst.grants}
        cores = sorted({g.core_percent for g in inst.grants})
        rows.append([inst.id, f"{inst.owner.kind.value}/{inst.owner.id}",
                     *[str(_gib_up(by_gpu[g.gpu.index].memory)) if g.gpu.index in by_gpu else "0" for g in info.gpus],
                     ",".join(str(c) for c in cores) if cores != [0] else "-"])
    lines = [f"NAME:       {info.hostname}", f"IPADDRESS:  {info.address or '-'}", "", *_table(rows), "",
             f"Allocated :  {allocated} ({_percent(allocated, total)}%)", f"Total :      {total}", RULE]
    return "\n".join(lines) + "\n"


def instance_list(instances: Sequence[Instance]) -> str:
    rows = [["ID", "STATE", "OWNER", "GPUS", "MEMORY(MiB)", "CORE(%)", "PIDS"]]
    for inst in instances:
        rows.append([
            inst.id, inst.state.value, f"{inst.owner.kind.value}/{inst.owner.id}",
            ",".join(str(g.gpu_index) for g in inst.grants),
            ",".join(str(g.memory >> 20) for g in inst.grants),
            ",".join(str(g.core_percent) for g in inst.grants),
            ",".join(str(p) for p in inst.pids) or "-",
        ])
    return "\n".join(_table(rows)) + "\n"


def as_json_instances(instances: Sequence[Instance]) -> list[dict[str, Any]]:
    return [{"id": i.id, "state": i.state.value, "owner": {"kind": i.owner.kind.value, "id": i.owner.id},
             "grants": [{"gpu": g.gpu_index, "uuid": g.gpu_uuid, "memory_bytes": g.memory,
                         "core_percent": g.core_percent} for g in i.grants],
             "pids": list(i.pids), "enforced": i.enforced} for i in instances]


def as_json(info: NodeInfo, instances: Sequence[Instance]) -> dict[str, Any]:
    allocated, total = _totals(info)
    return {
        "name": info.hostname,
        "ipaddress": info.address,
        "driver_version": info.driver_version,
        "mode": info.policy.mode.value,
        "placement": info.policy.placement.value,
        "compute_policy": int(info.policy.compute_policy),
        "gpus": [{"index": g.gpu.index, "uuid": g.gpu.uuid, "allocated_bytes": g.allocated, "total_bytes": g.gpu.memory,
                  "allocated_gib": _gib_up(g.allocated), "total_gib": _gib_down(g.gpu.memory),
                  "core_percent": g.core_percent, "instances": g.instances} for g in info.gpus],
        "allocated_gib": allocated,
        "total_gib": total,
        "instances": as_json_instances(instances),
    }
