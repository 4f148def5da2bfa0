"""A CDI device's container edits applied to an OCI spec the way containerd
applies them, for runc without containerd."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def apply_cdi(spec: dict[str, Any], device: dict[str, Any]) -> dict[str, Any]:
    edits = device["containerEdits"]
    spec["process"]["env"] = spec["process"].get("env", []) + edits.get("env", [])
    mounts = spec.get("mounts", []) + [
        {
            "destination": m["containerPath"],
            "source": m["hostPath"],
            "type": m.get("type", ""),
            "options": m.get("options", []),
        }
        for m in edits.get("mounts", [])
    ]
    # CDI keeps the order of equals and puts shallower targets first.
    spec["mounts"] = sorted(mounts, key=lambda m: len(Path(m["destination"]).parts))
    hooks = spec.setdefault("hooks", {})
    for h in edits.get("hooks", []):
        hooks.setdefault(h["hookName"], []).append({k: h[k] for k in ("path", "args", "env", "timeout") if k in h})
    return spec
