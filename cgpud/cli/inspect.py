"""`cgpuctl inspect`, `cgpuctl list` and `cgpuctl events`: the tables ACK
users know from `kubectl inspect cgpu`, for this node, and what the bypass
watchdog found. Pure formatting of what the daemon reports; memory in whole
GiB as ACK shows it (totals rounded down, so a 16 GB card shows 15;
allocations rounded up, never under-reported), except per-instance and
per-event amounts, which are MiB."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cgpud.node.bypass_model import BypassEvent, ViolationKind
from cgpud.node.model import GIB, Instance, NodeInfo

if TYPE_CHECKING:  # the kubectl plugin imports this module and needs no protobuf
    from cgpud.api.convert import BypassListing

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
    row = [
        info.hostname,
        info.address or "-",
        *[f"{_gib_up(g.allocated)}/{_gib_down(g.gpu.memory)}" for g in info.gpus],
        f"{allocated}/{total}",
    ]
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
        rows.append(
            [
                inst.id,
                f"{inst.owner.kind.value}/{inst.owner.id}",
                *[str(_gib_up(by_gpu[g.gpu.index].memory)) if g.gpu.index in by_gpu else "0" for g in info.gpus],
                ",".join(str(c) for c in cores) if cores != [0] else "-",
            ]
        )
    lines = [
        f"NAME:       {info.hostname}",
        f"IPADDRESS:  {info.address or '-'}",
        "",
        *_table(rows),
        "",
        f"Allocated :  {allocated} ({_percent(allocated, total)}%)",
        f"Total :      {total}",
        RULE,
    ]
    return "\n".join(lines) + "\n"


def instance_list(instances: Sequence[Instance], violations: Mapping[str, int] | None = None) -> str:
    """`violations`: bypass events per instance id; the column is left out
    without it."""
    rows = [
        [
            "ID",
            "STATE",
            "OWNER",
            "GPUS",
            "MEMORY(MiB)",
            "CORE(%)",
            "PIDS",
            *(["VIOLATIONS"] if violations is not None else []),
        ]
    ]
    for inst in instances:
        rows.append(
            [
                inst.id,
                inst.state.value,
                f"{inst.owner.kind.value}/{inst.owner.id}",
                ",".join(str(g.gpu_index) for g in inst.grants),
                ",".join(str(g.memory >> 20) for g in inst.grants),
                ",".join(str(g.core_percent) for g in inst.grants),
                ",".join(str(p) for p in inst.pids) or "-",
                *([str(violations.get(inst.id, 0))] if violations is not None else []),
            ]
        )
    return "\n".join(_table(rows)) + "\n"


def as_json_instances(
    instances: Sequence[Instance], violations: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {
            "id": i.id,
            "state": i.state.value,
            "owner": {"kind": i.owner.kind.value, "id": i.owner.id},
            "grants": [
                {"gpu": g.gpu_index, "uuid": g.gpu_uuid, "memory_bytes": g.memory, "core_percent": g.core_percent}
                for g in i.grants
            ],
            "pids": list(i.pids),
            "enforced": i.enforced,
        }
        for i in instances
    ]
    if violations is not None:
        for entry in out:
            entry["violations"] = violations.get(entry["id"], 0)
    return out


def as_json(
    info: NodeInfo, instances: Sequence[Instance], violations: Mapping[str, int] | None = None
) -> dict[str, Any]:
    allocated, total = _totals(info)
    return {
        "name": info.hostname,
        "ipaddress": info.address,
        "driver_version": info.driver_version,
        "mode": info.policy.mode.value,
        "placement": info.policy.placement.value,
        "compute_policy": int(info.policy.compute_policy),
        "gpus": [
            {
                "index": g.gpu.index,
                "uuid": g.gpu.uuid,
                "allocated_bytes": g.allocated,
                "total_bytes": g.gpu.memory,
                "allocated_gib": _gib_up(g.allocated),
                "total_gib": _gib_down(g.gpu.memory),
                "core_percent": g.core_percent,
                "instances": g.instances,
            }
            for g in info.gpus
        ],
        "allocated_gib": allocated,
        "total_gib": total,
        "instances": as_json_instances(instances, violations),
    }


# ---- bypass events ------------------------------------------------------------------------


def _when(unix: float) -> str:
    # UTC, as cgpud's log lines stamp the same events.
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _amount(event: BypassEvent) -> str:
    """What was found against what is allowed: memory in MiB (an unknown
    process is allowed none), compute in percent."""
    v = event.violation
    if v.kind is ViolationKind.COMPUTE_OVER_SHARE:
        return f"{v.measured_percent:.0f}/{v.allowed_percent:.0f}%"
    return f"{v.used_bytes >> 20}/{v.limit_bytes >> 20}MiB"


def _action(event: BypassEvent) -> str:
    if event.killed:
        return f"{event.action.value}:{','.join(map(str, event.killed))}"
    return event.action.value


def event_table(events: Sequence[BypassEvent], with_instance: bool = True) -> list[str]:
    """One line per event, oldest first. USED/ALLOWED is used/limit for
    memory and measured/allowed for compute; ACTION names the killed PIDs;
    DETAIL is why a kill failed, else the watchdog's own line."""
    header = [
        "TIME",
        "KIND",
        *(["INSTANCE"] if with_instance else []),
        "GPU",
        "PIDS",
        "USED/ALLOWED",
        "ACTION",
        "DETAIL",
    ]
    rows = [header]
    for e in events:
        v = e.violation
        rows.append(
            [
                _when(e.time),
                v.kind.value,
                *([v.instance_id or "-"] if with_instance else []),
                str(v.gpu_index),
                ",".join(map(str, v.pids)) or "-",
                _amount(e),
                _action(e),
                e.detail or v.detail or "-",
            ]
        )
    return _table(rows)


def watch_line(listing: BypassListing) -> str | None:
    """One plain line when the watchdog is off, else None."""
    if listing.watching:
        return None
    return f"the bypass watchdog is off: {listing.watch_detail or 'no reason given'}"


def events_text(listing: BypassListing, with_instance: bool = True) -> str:
    lines = [line] if (line := watch_line(listing)) else []
    if listing.events:
        lines += event_table(listing.events, with_instance)
    else:
        lines.append("no bypass events")
    return "\n".join(lines) + "\n"


def instance_details(inst: Instance, violations: int, listing: BypassListing) -> str:
    """`cgpuctl inspect -d ID`: the instance and its recent bypass events."""
    grants = "; ".join(
        f"gpu {g.gpu_index} {g.gpu_uuid} {g.memory >> 20} MiB" + (f" core {g.core_percent}%" if g.core_percent else "")
        for g in inst.grants
    )
    lines = [
        f"ID:          {inst.id}",
        f"STATE:       {inst.state.value}",
        f"OWNER:       {inst.owner.kind.value}/{inst.owner.id}",
        f"GRANTS:      {grants or '-'}",
        f"PIDS:        {','.join(map(str, inst.pids)) or '-'}",
        f"ENFORCED:    {'yes' if inst.enforced else 'no'}",
        f"VIOLATIONS:  {violations}",
        "",
        "Bypass events (newest last):",
    ]
    return "\n".join(lines) + "\n" + events_text(listing, with_instance=False)


def as_json_event(e: BypassEvent) -> dict[str, Any]:
    v = e.violation
    return {
        "time": e.time,
        "kind": v.kind.value,
        "instance_id": v.instance_id,
        "gpu": v.gpu_index,
        "pids": list(v.pids),
        "used_bytes": v.used_bytes,
        "limit_bytes": v.limit_bytes,
        "measured_percent": v.measured_percent,
        "allowed_percent": v.allowed_percent,
        "action": e.action.value,
        "killed": list(e.killed),
        "detail": v.detail,
        "action_detail": e.detail,
    }


def as_json_events(listing: BypassListing) -> dict[str, Any]:
    return {
        "watching": listing.watching,
        "watch_detail": listing.watch_detail,
        "events": [as_json_event(e) for e in listing.events],
    }
