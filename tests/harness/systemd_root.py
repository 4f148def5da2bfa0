"""A real systemd for the package tests (issue 42): Debian 12 "bookworm"
booted by `systemd-nspawn -b`, with systemd 252 as the container's PID 1
and `multi-user.target` reached, on a private overlay of a root
debootstrapped once and cached (tests/harness/older_root.py). The root
also carries python3 (for the tenants of tests/harness/restart_tenant.py),
runc, and rpm (Debian's, so the rpm's scriptlets run against a real
systemd too).

The simulated GPU stands in for the host's NVIDIA driver, which a host
installs apart from cgpu: its libraries and tools are copied to /sim in
the root (they outlive the package's upgrades and removal, as a driver
does), and cgpud.service is given them through a drop-in, as an operator
gives a service its environment.

Commands run inside through nsenter into every namespace of the
container's PID 1, so `systemctl` talks to that systemd. nspawn gets
`--register=no` (no machined here) and a private network (only loopback:
nothing of the container listens on this machine's addresses)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cgpud.native import native_path
from tests.harness.older_root import OlderRootError, Recipe, cached_root, older_root
from tests.harness.sim import write_sim_config
from tests.harness.teardown import terminate

BOOKWORM_SYSTEMD = Recipe("bookworm", ("systemd", "systemd-sysv", "dbus", "python3", "runc", "rpm"), "systemd", 2)
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SIM_ENV = {
    "LD_LIBRARY_PATH": "/sim/lib",
    "CGPU_SIM_CONFIG": "/sim/sim.conf",
    "CGPU_SIM_STATE": "/sim/sim.state",
}
DROP_IN = "/etc/systemd/system/cgpud.service.d/simulated-gpu.conf"
BOOT_TIMEOUT_S = 90


@dataclass(frozen=True)
class BootedRoot:
    """`leader` is the host PID of the container's systemd."""

    nspawn: subprocess.Popen[bytes]
    leader: int
    log: Path

    def host_path(self, inside: str | Path) -> Path:
        return Path(f"/proc/{self.leader}/root") / Path(inside).relative_to("/")

    def environment(self, **extra: str) -> dict[str, str]:
        return {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", **extra}

    def command(self, argv: Sequence[str | Path], env: dict[str, str] | None = None) -> list[str]:
        """argv run inside the container, in its namespaces, with env alone."""
        pairs = [f"{k}={v}" for k, v in (env or self.environment()).items()]
        return [
            "nsenter",
            "-t",
            str(self.leader),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "--",
            "/usr/bin/env",
            "-i",
            *pairs,
            *map(str, argv),
        ]

    def run(
        self, *argv: str | Path, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv, env), capture_output=True, text=True, timeout=timeout)

    def start(self, *argv: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(argv, env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", *args)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", ",".join(props))
        assert out.returncode == 0, out.stderr
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)

    def journal(self, unit: str, lines: int = 60) -> str:
        return self.run("journalctl", "-u", unit, "-n", str(lines), "--no-pager").stdout

    def copy_in(self, src: Path, inside: str) -> str:
        shutil.copy2(src, self.host_path(inside))
        return inside


def give_simulated_gpu(root: BootedRoot, gpus: int = 1, mem: str = "16GiB") -> dict[str, str]:
    """The simulated driver at /sim and cgpud.service's drop-in naming it;
    returns the environment a tenant inside needs to see the same GPUs."""
    sim = root.host_path("/sim")
    (sim / "lib").mkdir(parents=True)
    (sim / "bin").mkdir()
    for lib in native_path("sim").iterdir():
        if lib.name.endswith((".so", ".so.1")) or ".so." in lib.name:
            shutil.copy2(lib, sim / "lib" / lib.name, follow_symlinks=True)
    for tool in ("cgpu-burn", "cgpu-sim-stat"):
        shutil.copy2(native_path(f"bin/{tool}"), sim / "bin" / tool)
    write_sim_config(sim / "sim.conf", gpus=gpus, mem=mem)
    drop_in = root.host_path(DROP_IN)
    drop_in.parent.mkdir(parents=True)
    drop_in.write_text(
        "# The host's GPU driver, simulated (tests/harness/systemd_root.py).\n[Service]\n"
        + "".join(f"Environment={k}={v}\n" for k, v in SIM_ENV.items())
    )
    return root.environment(**SIM_ENV, PATH=f"/sim/bin:{PATH}")


def _leader(nspawn: subprocess.Popen[bytes], deadline: float) -> int:
    """The descendant of nspawn that is PID 1 of its own PID namespace."""
    while time.monotonic() < deadline:
        if nspawn.poll() is not None:
            raise OlderRootError(f"systemd-nspawn exited with {nspawn.returncode}")
        for pid in _descendants(nspawn.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if len(nspid) > 1 and nspid[-1] == "1":
                return pid
        time.sleep(0.05)
    raise OlderRootError("systemd-nspawn started no init")


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        found += map(int, children)
        todo += map(int, children)
    return found


@contextmanager
def booted_systemd(work: Path, recipe: Recipe = BOOKWORM_SYSTEMD) -> Iterator[BootedRoot]:
    """A booted systemd on a private overlay of the cached root."""
    cached_root(recipe)
    log = work / "nspawn.log"
    with older_root(work / "root", recipe, api_filesystems=False) as overlay, open(log, "wb") as out:
        nspawn = subprocess.Popen(
            overlay.beside(
                [
                    "systemd-nspawn",
                    "--quiet",
                    "--boot",
                    "--register=no",
                    "--keep-unit",
                    "--private-network",
                    "--console=pipe",
                    f"--directory={overlay.path}",
                ]
            ),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            root = BootedRoot(nspawn, _leader(nspawn, time.monotonic() + 30), log)
            state = _booted(root, time.monotonic() + BOOT_TIMEOUT_S)
            if state != "running":
                failed = root.systemctl("--failed", "--no-legend").stdout
                raise OlderRootError(f"systemd is {state!r} after boot; failed units:\n{failed}")
            yield root
        finally:
            terminate(nspawn, timeout=30)  # nspawn asks the container's systemd to halt on SIGTERM


def _booted(root: BootedRoot, deadline: float) -> str:
    """The system state once boot is over. `offline` until PID 1 is
    systemd and its bus answers; `--wait` then waits out `starting`."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "offline (no answer from systemd)"
        try:
            state = root.run("systemctl", "is-system-running", "--wait", timeout=left).stdout.strip()
        except subprocess.TimeoutExpired:
            return "starting (boot not finished)"
        if state not in ("offline", ""):
            return state
        time.sleep(0.1)


def monotonic_us_now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
