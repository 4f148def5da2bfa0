"""A real, throwaway Docker for the end-to-end tests, laid out as Debian's
docker.io runs it: dockerd on a containerd of its own
(`dockerd --containerd=<socket>`, as docker.service passes
/run/containerd/containerd.sock), so cgpu-runtime runs with containerd's
environment, not dockerd's. Each has its own root, state and socket under a
temp dir; no network set-up (no iptables, no bridge); the storage driver
dockerd picks itself (overlay2 where the temp dir's filesystem allows it,
as on a real host; vfs where it does not); images made by `docker import`
of the busybox rootfs the runc tests use. The client is named by
its full path because a newer one may come first on PATH."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.teardown import terminate
from tests.harness.wait import until

DOCKERD = Path("/usr/sbin/dockerd")
DOCKER = Path("/usr/bin/docker")
IMAGE = "cgpu-e2e:busybox"


@dataclass
class Dockerd:
    root: Path
    config: Path
    socket: Path
    relay: Path
    args: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        _wait("dockerd", lambda: self.docker("version").returncode == 0, self.proc, self.log)

    def reload(self) -> None:
        """What `systemctl reload docker` does."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def restart(self) -> None:
        """Stop dockerd and start it again: what an upgrade of docker.io does."""
        assert self.proc is not None
        terminate(self.proc, timeout=30)
        self.start()

    @property
    def task_dir(self) -> Path:
        """Where containerd makes a Docker container's bundle: <task_dir>/<id>."""
        return self.root / "run" / "containerd" / "io.containerd.runtime.v2.task" / "moby"

    def docker(self, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(DOCKER), "-H", f"unix://{self.socket}", *args], capture_output=True, text=True, timeout=timeout, **kw
        )

    def runtimes(self) -> dict[str, dict]:
        out = self.docker("info", "--format", "{{json .Runtimes}}")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def import_rootfs(self, rootfs: Path, tag: str, *changes: str) -> None:
        """An image of one layer: the rootfs as it is, symbolic links
        included; `changes` are Dockerfile lines (`ENV NAME=value`)."""
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-cf", "-", "."], stdout=subprocess.PIPE)
        flags = [a for c in changes for a in ("--change", c)]
        out = subprocess.run(
            [str(DOCKER), "-H", f"unix://{self.socket}", "import", *flags, "-", tag],
            stdin=tar.stdout,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        assert tar.wait() == 0 and out.returncode == 0, out.stderr

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def require_docker() -> None:
    missing = [str(p) for p in (DOCKERD, DOCKER) if not p.exists()]
    missing += [t for t in ("containerd", "containerd-shim-runc-v2") if shutil.which(t) is None]
    if missing:
        raise AssertionError(f"{', '.join(missing)} missing: apt-get install docker.io containerd")


def _wait(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    def tail() -> str:
        return f"{what}'s log ends:\n{log.read_text(errors='replace')[-3000:]}"

    def started() -> bool:
        if ready():
            return True
        if proc.poll() is not None:
            raise AssertionError(f"{what} did not start (exit {proc.returncode}): {tail()}")
        return False

    until(started, timeout=60, interval=0.1, what=f"{what} to start", explain=tail)


@contextmanager
def running_dockerd(
    root: Path, daemon_json: dict, containerd_env: dict[str, str], dockerd_path: Path | None = None
) -> Iterator[Dockerd]:
    """containerd (with `containerd_env`, which reaches cgpu-runtime) and a
    dockerd on it, with `dockerd_path` first on its PATH; when the block
    ends, however it ends, Docker's containers are removed, both daemons
    stopped and `root` deleted."""
    require_docker()
    with ExitStack() as stack:
        stack.callback(_remove, root)
        ctd = root / "containerd"
        ctd.mkdir(parents=True)
        # Bundles reached through a link, as /var/run -> /run on a real host:
        # cgpu keys a container by the bundle with links resolved.
        (root / "run").mkdir()
        (root / "var-run").symlink_to("run")
        (ctd / "config.toml").write_text(
            f'version = 2\nroot = "{ctd}/root"\nstate = "{root}/var-run/containerd"\n\n'
            f'[grpc]\n  address = "{ctd}/containerd.sock"\n'
        )
        ctd_log = ctd / "containerd.log"
        with open(ctd_log, "wb") as out:
            containerd = subprocess.Popen(
                ["containerd", "--config", str(ctd / "config.toml")],
                env=containerd_env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
            )
        stack.callback(terminate, containerd, timeout=30)
        stack.callback(_reap_containers, root, ctd / "containerd.sock")
        _wait("containerd", lambda: (ctd / "containerd.sock").exists(), containerd, ctd_log)

        config = root / "daemon.json"
        config.write_text(json.dumps(daemon_json, indent=4) + "\n")
        log = root / "dockerd.log"
        sock = root / "docker.sock"
        # dockerd's own environment says nothing of cgpu: only containerd's
        # reaches the runtime.
        env = {k: v for k, v in containerd_env.items() if not k.startswith("CGPU_")}
        if dockerd_path:
            env["PATH"] = f"{dockerd_path}:{env['PATH']}"
        args = [
            str(DOCKERD),
            "--containerd",
            str(ctd / "containerd.sock"),
            "--data-root",
            str(root / "data"),
            "--exec-root",
            str(root / "exec"),
            "-H",
            f"unix://{sock}",
            "--pidfile",
            str(root / "docker.pid"),
            "--config-file",
            str(config),
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
        ]
        d = Dockerd(root, config, sock, Path(containerd_env["CGPU_RELAY_SOCKET"]), args, env, log)
        stack.callback(_stop, d)
        d.start()
        yield d


def _stop(d: Dockerd) -> None:
    if d.proc is None:
        return
    if d.proc.poll() is None:
        left = d.docker("ps", "-aq").stdout.split()
        if left:
            d.docker("rm", "-f", *left)
    terminate(d.proc, timeout=30)


def _reap_containers(root: Path, containerd_socket: Path) -> None:
    """What a failed run leaves: containers dockerd did not remove (with
    live-restore they outlive it) and the shims of this containerd."""
    runc_root = root / "exec" / "runtime-runc" / "moby"
    if runc_root.is_dir():
        for container in runc_root.iterdir():
            subprocess.run(
                ["runc", "--root", str(runc_root), "delete", "--force", container.name], capture_output=True, timeout=60
            )
    address = str(containerd_socket).encode()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"containerd-shim-runc-v2") and address in argv:
            os.kill(int(proc.name), signal.SIGKILL)


def _remove(root: Path) -> None:
    # dockerd bind-mounts its data root onto itself and unmounts it on a
    # clean exit; after a kill it would stay.
    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split()[4].encode().decode("unicode_escape")
        if Path(point).is_relative_to(root):
            subprocess.run(["umount", "-l", point], check=False)
    shutil.rmtree(root, ignore_errors=True)
