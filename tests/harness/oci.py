"""Real OCI containers for the end-to-end tests: busybox rootfs bundles run
by real runc, directly or through cgpu-runtime.

The rootfs holds what a GPU image plus the NVIDIA container toolkit would
give a container: a C library, the workload (cgpu-burn) and the driver
libraries, bind-mounted from the host with the device state. Here the
driver is the simulated one, and this file plays the toolkit's part; cgpu
itself is given nothing but the bundle."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cgpud.node.region import SPARE_REGION
from cgpud.native import native_path
from tests.harness.cluster import NETNS_PREFIX, ROOT_PREFIX

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
APPLETS = ("sh", "true", "env", "cat", "sleep", "echo", "ls", "mount", "test", "touch", "id", "grep")
HOOK_ENV_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class MissingTool(AssertionError):
    pass


def require_tools() -> None:
    """The e2e tests need root, runc and a static busybox; CI installs them
    (`./dev test` does as root). Fail loudly rather than skip."""
    if os.geteuid() != 0:
        raise MissingTool("the container tests need root (runc creates namespaces and mounts)")
    missing = [t for t in ("runc",) if shutil.which(t) is None]
    if not any(Path(b).exists() for b in BUSYBOX_CANDIDATES):
        missing.append("busybox-static")
    if missing:
        raise MissingTool(f"install {' '.join(missing)} (apt-get install runc containerd busybox-static)")


def _busybox() -> Path:
    for candidate in BUSYBOX_CANDIDATES:
        p = Path(candidate)
        if p.exists():
            if subprocess.run(["ldd", str(p)], capture_output=True).returncode != 0:  # not dynamic
                return p
    raise MissingTool("no static busybox found: apt-get install busybox-static")


def _shared_libs(binary: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            libs.append(Path(path))
    return libs


def _copy_in(root: Path, host: Path, inside: str | None = None) -> None:
    dest = root / (inside or str(host)).lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(host.resolve(), dest)


def build_rootfs(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    shutil.copy2(_busybox(), root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    for d in ("etc", "tmp", "proc", "sys", "dev", "run", "usr/lib/x86_64-linux-gnu"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    burn = native_path("bin/cgpu-burn")
    _copy_in(root, burn, "/usr/bin/cgpu-burn")
    for binary in (burn, native_path("lib/libcgpu.so"), native_path("sim/libcuda.so.1")):
        for lib in _shared_libs(binary):
            _copy_in(root, lib)
    # The driver libraries, where the toolkit would put them.
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        _copy_in(root, native_path(f"sim/{name}"), f"/usr/lib/x86_64-linux-gnu/{name}")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\nuser:x:1000:1000::/:/bin/sh\n")
    return root


@dataclass
class Bundle:
    path: Path
    spec: dict[str, Any]

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs"

    def write(self) -> Bundle:
        (self.path / "config.json").write_text(json.dumps(self.spec, indent=1))
        return self

    def read(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())


def default_spec() -> dict[str, Any]:
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"cgpu-runc-spec-{os.getpid()}"
    scratch.mkdir(exist_ok=True)
    try:
        subprocess.run(["runc", "spec"], cwd=scratch, check=True, capture_output=True)
        return json.loads((scratch / "config.json").read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass
class Host:
    """What the host provides every container: the rootfs template, the
    simulated device (state shared with the host), runc's state root."""

    template: Path
    sim_dir: Path
    sim_env: dict[str, str]
    runc_root: Path
    spec_template: dict[str, Any]
    counter: list[int] = field(default_factory=lambda: [0])

    def bundle(self, where: Path, args: list[str], env: tuple[str, ...] = (), gpu_device: bool = True) -> Bundle:
        """A bundle whose rootfs shares the template's files by hard link
        (tests replace, never modify, files in it)."""
        where.mkdir(parents=True)
        subprocess.run(["cp", "-al", str(self.template), str(where / "rootfs")], check=True)
        spec = json.loads(json.dumps(self.spec_template))
        spec["process"]["terminal"] = False
        spec["process"]["args"] = args
        spec["process"]["env"] = [HOOK_ENV_PATH, *env]
        spec["root"] = {"path": "rootfs", "readonly": False}
        if gpu_device:
            # The toolkit's part: device state in, and the driver told where it is.
            spec["mounts"].append(
                {
                    "destination": str(self.sim_dir),
                    "type": "bind",
                    "source": str(self.sim_dir),
                    "options": ["rbind", "rw"],
                }
            )
            spec["process"]["env"] += [
                f"CGPU_SIM_CONFIG={self.sim_env['CGPU_SIM_CONFIG']}",
                f"CGPU_SIM_STATE={self.sim_env['CGPU_SIM_STATE']}",
            ]
        return Bundle(where, spec).write()

    def new_id(self, prefix: str = "cgpu-e2e") -> str:
        self.counter[0] += 1
        return f"{prefix}-{os.getpid()}-{self.counter[0]}"


def plant_symlink(root: Path, link: str, target: str) -> Path:
    """Makes `link` (an absolute path inside the image) in root a symbolic
    link to target, whatever stood there: how a hostile image points cgpu's
    paths elsewhere. Returns the link's path on the host."""
    inside = root / link.lstrip("/")
    if inside.is_dir() and not inside.is_symlink():
        subprocess.run(["rm", "-rf", str(inside)], check=True)
    else:
        inside.unlink(missing_ok=True)
    inside.parent.mkdir(parents=True, exist_ok=True)
    inside.symlink_to(target)
    return inside


def runtime_env(relay: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base or os.environ)
    env["CGPU_RELAY_SOCKET"] = str(relay)
    env["CGPU_REAL_RUNTIME"] = shutil.which("runc") or "runc"
    return env


def run(
    host: Host,
    bundle: Bundle,
    container_id: str,
    *,
    shim: bool,
    relay: Path | None = None,
    timeout: float = 60,
    wrapper: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """`runc run` of the bundle in the foreground, through the shim or not
    (under `wrapper`, tests/harness/old_kernel.py's launcher, if given)."""
    binary = str(native_path("bin/cgpu-runtime")) if shim else "runc"
    env = runtime_env(relay) if relay else dict(os.environ)
    return subprocess.run(
        [*wrapper, binary, "--root", str(host.runc_root), "run", "--bundle", str(bundle.path), container_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def runc(
    host: Host,
    *args: str,
    shim: bool = False,
    relay: Path | None = None,
    timeout: float = 60,
    wrapper: Sequence[str] = (),
    **kw: Any,
) -> subprocess.CompletedProcess[str]:
    binary = str(native_path("bin/cgpu-runtime")) if shim else "runc"
    env = runtime_env(relay) if relay else dict(os.environ)
    return subprocess.run(
        [*wrapper, binary, "--root", str(host.runc_root), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def create(
    host: Host,
    bundle: Bundle,
    container_id: str,
    relay: Path,
    timeout: float = 60,
    pid_file: Path | None = None,
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
) -> tuple[int, str]:
    """`runc create` through the shim; the container's stdio goes to a file
    in the bundle (a pipe would stay open as long as the container runs).
    With pid_file (as containerd and docker always pass it) the shim binds
    the instance itself; without, runc's createRuntime hook does."""
    extra = ["--pid-file", str(pid_file)] if pid_file else []
    shim = str(native_path("bin/cgpu-runtime"))
    command = [
        *wrapper,
        shim,
        "--root",
        str(host.runc_root),
        "create",
        "--bundle",
        str(bundle.path),
        *extra,
        container_id,
    ]
    return _create_logged(command, bundle, env or runtime_env(relay), timeout)


def plain_create(host: Host, bundle: Bundle, container_id: str, timeout: float = 60) -> tuple[int, str]:
    """`runc create` by runc itself, no cgpu-runtime before it (what runs
    is only what the bundle's hooks run); stdio to a file as in create."""
    command = ["runc", "--root", str(host.runc_root), "create", "--bundle", str(bundle.path), container_id]
    return _create_logged(command, bundle, dict(os.environ), timeout)


def _create_logged(command: list[str], bundle: Bundle, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Runs a create with the container's stdio in a file in the bundle: a
    pipe would stay open as long as the container runs. Its exit code and
    the file's text."""
    log = bundle.path / "stdio.log"
    with open(log, "w") as out:
        proc = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=timeout)
    return proc.returncode, log.read_text()


@contextmanager
def shim_container(
    host: Host, bundle: Bundle, container_id: str, relay: Path, *, start: bool = True, pid_file: bool = False
) -> Iterator[None]:
    """A container created (and started) through the shim for the block;
    killed and deleted through it after, however the block ends. pid_file:
    created as containerd does it, so the shim binds and releases."""
    code, log = create(
        host, bundle, container_id, relay, pid_file=bundle.path / f"{container_id}.pid" if pid_file else None
    )
    assert code == 0, log
    try:
        if start:
            assert runc(host, "start", container_id, shim=True, relay=relay).returncode == 0
        yield
    finally:
        runc(host, "kill", container_id, "KILL", shim=True, relay=relay)
        deleted = runc(host, "delete", "--force", container_id, shim=True, relay=relay)
    assert deleted.returncode == 0, deleted.stderr


NETNS_DIR = Path("/run/netns")  # where `ip netns add` pins a namespace
CLUSTER_TMP = Path("/tmp")  # where the cluster harness makes its run directory


def host_mounts(ours: Path | None = None) -> list[str]:
    """The host's mount table. cgpud's spare region is remade after every
    start, so its line changes (mount id, device): it is counted, not
    listed, and a leak still shows in the count. With `ours` (a pytest
    base temp dir), the mounts other pytest sessions and xdist workers make
    under the same pytest-of-<user> dir are left out: their cgpuds come and
    go meanwhile; so are the test clusters' network namespaces. A mount
    anywhere else still counts."""
    lines = [
        line
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if ours is None or not _others(line, ours)
    ]
    mine = [line for line in lines if not _spare(line)]
    return mine + [f"spare regions: {len(lines) - len(mine)}"]


def _others(line: str, ours: Path) -> bool:
    root = next((p for p in (ours, *ours.parents) if p.name.startswith("pytest-of-")), ours)
    point = Path(line.split()[4].encode().decode("unicode_escape"))
    if point.parent == NETNS_DIR and point.name.startswith(NETNS_PREFIX):
        return True  # a test cluster's node namespace (tests/harness/cluster.py), not a container's
    if point.is_relative_to(CLUSTER_TMP) and point.relative_to(CLUSTER_TMP).parts[0].startswith(ROOT_PREFIX):
        return True  # a test cluster node's regions: that cluster's cgpuds come and go meanwhile
    return point.is_relative_to(root) and not point.is_relative_to(ours)


def _spare(line: str) -> bool:
    point = Path(line.split()[4].encode().decode("unicode_escape"))
    return point.name == SPARE_REGION and point.parent.name == "instances"


T = TypeVar("T")


def steady_mounts(read: Callable[[], list[str]], within: float = 5.0) -> list[str]:
    """host_mounts-style `read` once no spare region is being remade: cgpud
    mounts the new spare before the one it replaces is gone, so a read can
    catch two of one cgpud's at once and make a wrong baseline. Waits for at
    most one spare (the count itself after `within`: several cgpuds)."""
    now = read()
    count = int(now[-1].rsplit(" ", 1)[1])
    return settled(read, [*now[:-1], f"spare regions: {min(count, 1)}"], within)


def settled(read: Callable[[], T], expected: T, within: float = 5.0) -> T:
    """What `read` gives once it equals `expected`, or its last value after
    `within` seconds. cgpud releases an instance, and unmounts its region, at
    the container's exit: a few milliseconds after the runtime has returned,
    not before."""
    deadline = time.monotonic() + within
    while (got := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return got
