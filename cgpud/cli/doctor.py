"""`cgpuctl doctor`: checks what cgpu needs on this node and says what to fix."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cgpud.cli.docker_config import DOCKER_CONFIG, parse_daemon_json
from cgpud.cli.toolkit_config import TOOLKIT_CONFIG, toolkit_gaps
from cgpud.config import DaemonConfig
from cgpud.node.region import REGION_FS_FILE, SPARE_REGION
from cgpud.errors import CgpuError, UsageError

CONTAINERD_DROPINS = Path("/etc/containerd/conf.d")


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _nvml() -> str:
    from cgpud.node.inventory import read_inventory

    inv = read_inventory()
    return f"{len(inv.gpus)} GPU(s), driver {inv.driver_version}"


DAEMON_ANSWER_S = 5.0


def _daemon(socket: Path) -> Callable[[], str]:
    def check() -> str:
        from cgpud.cli.client import LocalClient

        # A check, not a wait: a cgpud that holds the connection without
        # answering for this long is reported, not waited out.
        with LocalClient(socket, timeout=DAEMON_ANSWER_S) as client:
            info = client.node_info()
        return f"cgpud answers on {socket} ({info.policy.mode.value} mode)"

    return check


def _state_dir(path: Path) -> Callable[[], str]:
    def check() -> str:
        if not path.is_dir():
            raise CgpuError(f"{path} does not exist; cgpud creates it at start (is it running with this config?)")
        if path.stat().st_mode & 0o077:
            raise CgpuError(f"{path} is open to other users; run: chmod 700 {path} (cgpud does at start)")
        return str(path)

    return check


def _regions(regions: Path) -> Callable[[], str]:
    """Whether each instance region is a tmpfs of its own (cgpud records how
    it held the first one of its run in .filesystem)."""

    def check() -> str:
        try:
            how = (regions / REGION_FS_FILE).read_text().strip()
        except FileNotFoundError:
            return "no instance region yet"
        except OSError as e:
            raise CgpuError(f"cannot read {regions / REGION_FS_FILE}: {e.strerror}") from e
        dirs = [d for d in regions.iterdir() if d.is_dir() and d.name != SPARE_REGION]
        plain = [d for d in dirs if not d.is_mount()]
        if how != "tmpfs" or plain:
            why = how.removeprefix("plain: ") if how != "tmpfs" else "created before cgpud could mount"
            raise CgpuError(
                f"{len(plain)} of {len(dirs)} instance regions are plain directories on the state "
                f"filesystem ({why}): a tenant can fill that filesystem through its usage file; run "
                "cgpud as root with CAP_SYS_ADMIN so each region gets a small tmpfs of its own"
            )
        return f"{len(dirs)} on a tmpfs of their own"

    return check


def _library() -> str:
    from cgpud.native import native_path

    return str(native_path("lib/libcgpu.so"))


def _docker_runtimes(path: Path) -> list[str]:
    """The runtimes daemon.json registers that run cgpu-runtime (by the name
    `runtime configure` gives or by the program), each checked to exist."""
    try:
        text: str | None = path.read_text()
    except FileNotFoundError:
        text = None
    except (OSError, UnicodeDecodeError) as e:
        raise CgpuError(f"cannot read {path}: {e}") from None
    # A malformed daemon.json is reported as such (parse_daemon_json's error),
    # not as a missing entry: dockerd does not start with it either.
    runtimes = parse_daemon_json(path, text).get("runtimes")
    found = []
    for name, entry in runtimes.items() if isinstance(runtimes, dict) else ():
        program = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(program, str) or (name != "cgpu" and Path(program).name != "cgpu-runtime"):
            continue
        # dockerd looks a relative name up on its PATH.
        resolved = program if Path(program).is_absolute() else shutil.which(program)
        if not resolved or not Path(resolved).is_file() or not os.access(resolved, os.X_OK):
            raise CgpuError(
                f'{path}: runtime "{name}" runs {program}, which is not an executable file, so '
                f"`docker run --runtime {name}` fails; run: cgpuctl runtime configure --docker"
            )
        found.append(f'docker: runtime "{name}" runs {program} ({path})')
    return found


def running_dockerd_configs(proc: Path = Path("/proc")) -> list[Path]:
    """The daemon.json each running dockerd reads: its --config-file, or
    the default. Checking that file, not a guess, is what tells whether
    `docker run --runtime cgpu` can work."""
    configs = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [os.fsdecode(a) for a in (entry / "cmdline").read_bytes().split(b"\0")]
            if Path(argv[0]).name != "dockerd":
                continue
            config = DOCKER_CONFIG
            for i, arg in enumerate(argv[1:], 1):
                if arg == "--config-file" and i + 1 < len(argv):
                    config = Path(argv[i + 1])
                elif arg.startswith("--config-file="):
                    config = Path(arg.split("=", 1)[1])
            configs.add(config if config.is_absolute() else Path(os.readlink(entry / "cwd")) / config)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(configs)


def _runtime(docker_configs: Sequence[Path] = ()) -> str:
    dropins = sorted(CONTAINERD_DROPINS.glob("*cgpu*")) if CONTAINERD_DROPINS.is_dir() else []
    found = [f"containerd: {dropins[0]}"] if dropins else []
    for path in docker_configs or [DOCKER_CONFIG]:
        found += _docker_runtimes(path)
    if found:
        return "; ".join(found)
    raise CgpuError(
        "no containerd or docker runtime entry for cgpu; containers get no limits until one is "
        "configured (host processes work through `cgpuctl run`)"
    )


def _toolkit(path: Path) -> Callable[[], str]:
    def check() -> str:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return f"not installed ({path} absent): GPUs reach containers only as cgpu hands them out"
        except OSError as e:
            raise CgpuError(f"cannot read {path}: {e.strerror}") from None
        try:
            gaps = toolkit_gaps(path, text)
        except UsageError as e:
            raise CgpuError(str(e)) from None
        if gaps:
            raise CgpuError(
                f"{path} lacks {', '.join(gaps)}: a container whose image sets "
                "NVIDIA_VISIBLE_DEVICES=all gets every GPU without an instance; run "
                "`cgpuctl runtime configure --nvidia-toolkit`"
            )
        return f"gives GPUs only from the device lists cgpud answers with ({path})"

    return check


def diagnose(
    config: DaemonConfig, socket: Path, docker_config: Path | None = None, toolkit_config: Path = TOOLKIT_CONFIG
) -> list[Finding]:
    """`docker_config`: the daemon.json to check; by default the one each
    running dockerd reads, or /etc/docker/daemon.json with none running."""
    docker_configs = [docker_config] if docker_config else running_dockerd_configs()
    checks: list[tuple[str, Callable[[], str], bool]] = [
        ("driver/NVML", _nvml, True),
        ("daemon socket", _daemon(socket), True),
        ("state directory", _state_dir(config.state_dir), True),
        ("instance regions", _regions(config.regions), False),
        ("libcgpu.so", _library, True),
        ("container runtime", lambda: _runtime(docker_configs), False),
        ("NVIDIA toolkit", _toolkit(toolkit_config), False),
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
