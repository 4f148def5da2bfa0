"""`cgpuctl doctor`: checks what cgpu needs on this node and says what to fix."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cgpud.daemon.config import DaemonConfig
from cgpud.errors import CgpuError

CONTAINERD_DROPINS = Path("/etc/containerd/conf.d")
DOCKER_CONFIG = Path("/etc/docker/daemon.json")


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _nvml() -> str:
    from cgpud.daemon.inventory import read_inventory

    inv = read_inventory()
    return f"{len(inv.gpus)} GPU(s), driver {inv.driver_version}"


def _daemon(socket: Path) -> Callable[[], str]:
    def check() -> str:
        from cgpud.cli.client import LocalClient

        with LocalClient(socket) as client:
            info = client.node_info()
        return f"cgpud answers on {socket} ({info.policy.mode.value} mode)"

    return check


def _state_dir(path: Path) -> Callable[[], str]:
    def check() -> str:
        if not path.is_dir():
            raise CgpuError(f"{path} does not exist; cgpud creates it at start (is it running with this config?)")
        if path.stat().st_mode & 0o022:
            raise CgpuError(f"{path} is writable by others; run: chmod go-w {path}")
        return str(path)

    return check


def _library() -> str:
    from cgpud.native import native_path

    return str(native_path("lib/libcgpu.so"))


def _runtime() -> str:
    dropins = sorted(CONTAINERD_DROPINS.glob("*cgpu*")) if CONTAINERD_DROPINS.is_dir() else []
    if dropins:
        return f"containerd: {dropins[0]}"
    try:
        if "cgpu" in json.loads(DOCKER_CONFIG.read_text()).get("runtimes", {}):
            return f"docker: {DOCKER_CONFIG}"
    except (OSError, ValueError, AttributeError):
        pass
    raise CgpuError("no containerd or docker runtime entry for cgpu; containers get no limits until one is "
                    "configured (host processes work through `cgpuctl run`)")


def diagnose(config: DaemonConfig, socket: Path) -> list[Finding]:
    checks: list[tuple[str, Callable[[], str], bool]] = [
        ("driver/NVML", _nvml, True),
        ("daemon socket", _daemon(socket), True),
        ("state directory", _state_dir(config.state_dir), True),
        ("libcgpu.so", _library, True),
        ("container runtime", _runtime, False),
    ]
    findings = []
    for name, check, required in checks:
        try:
            findings.append(Finding(name, True, check(), required))
        except CgpuError as e:
            findings.append(Finding(name, False, str(e), required))
    return findings


def report(findings: list[Finding]) -> tuple[str, int]:
    lines = []
    for f in findings:
        mark = "ok  " if f.ok else ("FAIL" if f.required else "warn")
        lines.append(f"{mark}  {f.name}: {f.detail}")
    failed = any(not f.ok and f.required for f in findings)
    return "\n".join(lines) + "\n", 1 if failed else 0
