"""NVIDIA MPS on an `mps` node (docs/modes.md). Per GPU: compute mode
EXCLUSIVE_PROCESS through NVML, so only the MPS server and its clients get a
context there, and an `nvidia-cuda-mps-control -d` of its own
(CUDA_VISIBLE_DEVICES=<the GPU's UUID>, its own pipe and log directories
under <runtime dir>/mps/<GPU index>/: per boot, as the compute mode is, and
short, as a socket path must be). A watcher thread restarts a daemon that
dies. On stop, a GPU whose server has no client left gets `quit` and its
compute mode back; one with clients keeps both, and the next cgpud adopts
the daemon from its pid file (a restart must not kill running pods' work).

The pure decisions come first (paths, a container's environment, restart
pacing, what to stop); MpsControl does the I/O: NVML, the control program,
pid files and pidfds."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from cgpud.atomicfile import write_atomic
from cgpud.errors import CgpuError
from cgpud.node.model import Instance
from cgpud.units import MIB

CONTROL = "nvidia-cuda-mps-control"  # found on PATH, where NVIDIA's driver installs it
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
CONTAINER_PIPE = "/tmp/nvidia-mps"  # MPS's own default: where a client looks without the variable
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEM_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
CLIENT_ENV = (PIPE_ENV, PERCENT_ENV, MEM_LIMIT_ENV)
# nvmlComputeMode_t
COMPUTEMODE_DEFAULT = 0
COMPUTEMODE_EXCLUSIVE_PROCESS = 3
SAVED_MODE_FILE = "compute-mode"
SUN_PATH_MAX = 107  # the mode found before cgpud set EXCLUSIVE_PROCESS

WATCH_S = 0.2  # how often the watcher looks at the daemons
COMMAND_TIMEOUT_S = 10.0
QUIT_WAIT_S = 10.0
RESTART_WINDOW_S = 60.0
RESTART_BURST = 3  # deaths in the window restarted at once; then backing off
RESTART_MAX_DELAY_S = 30.0


# ---- pure ------------------------------------------------------------------------


def gpu_dir(root: Path, index: int) -> Path:
    return root / str(index)


def pipe_dir(root: Path, index: int) -> Path:
    """The GPU's pipe directory: its control socket, the only file of cgpud's
    a container on that GPU gets (read-only) for MPS."""
    return gpu_dir(root, index) / "pipe"


def log_dir(root: Path, index: int) -> Path:
    return gpu_dir(root, index) / "log"


def client_env(core_percent: int, memory: int) -> dict[str, str]:
    """A container's MPS variables: the pipe directory where it is mounted,
    its core share as the active thread percentage (none without a share:
    the server's 100), its memory as the pinned device memory limit of its
    one device (ordinal 0: a client sees its server's one GPU), in MiB."""
    env = {PIPE_ENV: CONTAINER_PIPE, MEM_LIMIT_ENV: f"0={max(memory // MIB, 1)}M"}
    if core_percent:
        env[PERCENT_ENV] = str(core_percent)
    return env


def mps_pipe(instance: Instance, pipes: Mapping[int, Path]) -> Path | None:
    """The one pipe directory of a one-GPU instance on an MPS GPU; None for
    any other (admission gives mps nodes one GPU per container)."""
    if len(instance.grants) != 1:
        return None
    return pipes.get(instance.grants[0].gpu_index)


def restart_delay(deaths: Sequence[float], now: float) -> float:
    """Seconds to wait before starting a daemon again, given when it died
    (oldest first, the latest death last): at once for the first
    RESTART_BURST deaths in RESTART_WINDOW_S, then doubling from one second
    up to RESTART_MAX_DELAY_S after the latest death, so a daemon that
    cannot live is not respawned in a loop."""
    recent = [t for t in deaths if now - t <= RESTART_WINDOW_S]
    if len(recent) <= RESTART_BURST:
        return 0.0
    delay = min(2.0 ** (len(recent) - RESTART_BURST - 1), RESTART_MAX_DELAY_S)
    return max(recent[-1] + delay - now, 0.0)


def to_quit(clients: Mapping[int, int | None]) -> list[int]:
    """At stop, the GPUs (by index) whose daemon goes: those whose server has
    no client. A count that could not be read (None) keeps the daemon: a
    pod's work is worth more than a daemon left running."""
    return sorted(i for i, n in clients.items() if n == 0)


def daemon_env(base: Mapping[str, str], root: Path, index: int, uuid: str) -> dict[str, str]:
    """The control daemon's environment: cgpud's, less any MPS setting or
    device list of its own, with the GPU's directories and only its GPU."""
    env = {k: v for k, v in base.items() if not k.startswith("CUDA_MPS_") and k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = uuid
    env[PIPE_ENV] = str(pipe_dir(root, index))
    env[LOG_ENV] = str(log_dir(root, index))
    return env


# ---- I/O -------------------------------------------------------------------------


class MpsError(CgpuError):
    pass


@dataclass(frozen=True)
class MpsGpu:
    index: int
    uuid: str


@dataclass
class _Daemon:
    gpu: MpsGpu
    pid: int = 0
    pidfd: int = -1
    deaths: list[float] = field(default_factory=list)
    next_start: float = 0.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _socket_answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class MpsControl:
    """The node's MPS control daemons, one per GPU. `start` sets the compute
    modes and starts (or adopts) the daemons; `watch` runs until `stop` is
    set, restarting any that dies; `stop` quits the idle ones and puts their
    compute mode back."""

    def __init__(
        self,
        root: Path,
        gpus: Sequence[MpsGpu],
        *,
        control: str | None = None,
        nvml: Any = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.root = root
        self._nvml = nvml
        self._control = control or CONTROL
        self._environ = dict(os.environ if environ is None else environ)
        self._clock = clock
        self._daemons = [_Daemon(g) for g in gpus]
        self._lock = threading.Lock()
        self._log = structlog.get_logger("cgpud.mps")

    # -- the GPUs' directories and modes --

    def pipes(self) -> dict[int, Path]:
        """GPU index -> its pipe directory."""
        return {d.gpu.index: pipe_dir(self.root, d.gpu.index) for d in self._daemons}

    def _prepare_dirs(self, gpu: MpsGpu) -> None:
        sock = pipe_dir(self.root, gpu.index) / CONTROL_SOCKET
        if len(os.fsencode(sock)) > SUN_PATH_MAX:
            raise MpsError(
                f"the MPS control socket {sock} would be longer than the {SUN_PATH_MAX} bytes a unix socket "
                "path may have: give cgpud a shorter socket directory"
            )
        try:
            self.root.mkdir(mode=0o755, parents=True, exist_ok=True)
            for d in (gpu_dir(self.root, gpu.index), pipe_dir(self.root, gpu.index), log_dir(self.root, gpu.index)):
                d.mkdir(mode=0o755, exist_ok=True)
                d.chmod(0o755)  # clients of any user reach the socket inside
        except OSError as e:
            raise MpsError(
                f"cannot prepare the MPS directories of GPU {gpu.index} under {self.root}: {e.strerror}"
            ) from e

    def _set_mode(self, gpu: MpsGpu, mode: int) -> None:
        n = self._nvml
        try:
            n.nvmlDeviceSetComputeMode(n.nvmlDeviceGetHandleByUUID(gpu.uuid.encode()), mode)
        except n.NVMLError as e:
            raise MpsError(f"cannot set the compute mode of GPU {gpu.index} ({gpu.uuid}) to {mode}: {e}") from e

    def _exclusive(self, gpu: MpsGpu) -> None:
        """EXCLUSIVE_PROCESS, keeping the mode found first (once: a cgpud
        restarted after a crash finds its own EXCLUSIVE_PROCESS set)."""
        n = self._nvml
        saved = gpu_dir(self.root, gpu.index) / SAVED_MODE_FILE
        try:
            if not saved.exists():
                found = n.nvmlDeviceGetComputeMode(n.nvmlDeviceGetHandleByUUID(gpu.uuid.encode()))
                write_atomic(saved, f"{int(found)}\n".encode(), 0o644)
        except n.NVMLError as e:
            raise MpsError(f"cannot read the compute mode of GPU {gpu.index} ({gpu.uuid}): {e}") from e
        self._set_mode(gpu, COMPUTEMODE_EXCLUSIVE_PROCESS)

    def _restore_mode(self, gpu: MpsGpu) -> None:
        saved = gpu_dir(self.root, gpu.index) / SAVED_MODE_FILE
        if not saved.exists():
            return  # never set by cgpud
        try:
            mode = int(saved.read_text().strip())
        except (OSError, ValueError):
            mode = COMPUTEMODE_DEFAULT
        self._set_mode(gpu, mode)
        saved.unlink(missing_ok=True)

    # -- the daemons --

    def command(self, gpu: MpsGpu, *lines: str) -> str:
        """The answer of the GPU's control daemon to `lines` (stdin commands)."""
        env = daemon_env(self._environ, self.root, gpu.index, gpu.uuid)
        try:
            r = subprocess.run(
                [self._control],
                input="".join(f"{line}\n" for line in lines),
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"{self._control} did not answer for GPU {gpu.index}: {e}") from e
        if r.returncode != 0:
            raise MpsError(f"{self._control} failed for GPU {gpu.index}: {r.stderr.strip() or r.returncode}")
        return r.stdout

    def clients(self, gpu: MpsGpu) -> int:
        """How many clients the GPU's server has (0 without a server)."""
        servers = self.command(gpu, "get_server_list").split()
        return sum(len(self.command(gpu, f"get_client_list {s}").split()) for s in servers)

    def _adopt(self, d: _Daemon) -> bool:
        """A daemon from before a restart of cgpud, still answering."""
        pipe = pipe_dir(self.root, d.gpu.index)
        try:
            pid = int((pipe / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return False
        if not _pid_alive(pid) or not _socket_answers(pipe / CONTROL_SOCKET):
            return False
        self._track(d, pid)
        self._log.info("MPS control daemon adopted", gpu=d.gpu.index, pid=pid)
        return True

    def _track(self, d: _Daemon, pid: int) -> None:
        if d.pidfd >= 0:
            os.close(d.pidfd)
        d.pid = pid
        try:
            d.pidfd = os.pidfd_open(pid)
        except OSError:
            d.pidfd = -1  # gone already: the watcher sees it dead

    def _spawn(self, d: _Daemon) -> None:
        uuid = d.gpu.uuid
        env = daemon_env(self._environ, self.root, d.gpu.index, uuid)
        pipe = pipe_dir(self.root, d.gpu.index)
        (pipe / PID_FILE).unlink(missing_ok=True)
        try:
            r = subprocess.run(
                [self._control, "-d"], env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
            )
        except FileNotFoundError as e:
            raise MpsError(
                f"mps mode needs NVIDIA's MPS: {self._control} is not on cgpud's PATH "
                "(install the driver's compute utilities, or run the node in another mode)"
            ) from e
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"cannot start {self._control} for GPU {d.gpu.index} ({uuid}): {e}") from e
        if r.returncode != 0:
            raise MpsError(
                f"{self._control} -d failed for GPU {d.gpu.index} ({uuid}): {r.stderr.strip() or r.returncode}"
            )
        try:
            pid = int((pipe / PID_FILE).read_text().strip())
        except (OSError, ValueError) as e:
            raise MpsError(f"{self._control} for GPU {d.gpu.index} wrote no pid file in {pipe}") from e
        self._track(d, pid)
        self._log.info("MPS control daemon started", gpu=d.gpu.index, pid=pid, pipe=str(pipe))

    def start(self) -> None:
        """Every GPU exclusive to MPS and its daemon running. Raises MpsError
        (having stopped what it started) when a GPU cannot be made so."""
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as e:
            raise MpsError(f"cannot initialise NVML to set the GPUs' compute mode for MPS: {e}") from e
        try:
            for d in self._daemons:
                self._prepare_dirs(d.gpu)
                self._exclusive(d.gpu)
                if not self._adopt(d):
                    self._spawn(d)
        except MpsError:
            self.stop(force=True)
            raise

    def _dead(self, d: _Daemon) -> bool:
        if d.pid == 0:
            return True
        if d.pidfd >= 0:
            readable, _, _ = select.select([d.pidfd], [], [], 0)
            return bool(readable)
        return not _pid_alive(d.pid)

    def check(self) -> None:
        """One look: a daemon that died is started again (paced by restart_delay)."""
        with self._lock:
            for d in self._daemons:
                if not self._dead(d):
                    continue
                now = self._clock()
                if d.pid:
                    self._log.error("MPS control daemon died", gpu=d.gpu.index, pid=d.pid)
                    d.deaths = [*d.deaths[-(RESTART_BURST + 8) :], now]
                    d.pid = 0
                    d.next_start = now + restart_delay(d.deaths, now)
                if now < d.next_start:
                    continue
                try:
                    self._spawn(d)
                except MpsError as e:
                    self._log.error("MPS control daemon not restarted", gpu=d.gpu.index, error=str(e))
                    d.deaths.append(now)
                    d.next_start = now + max(restart_delay(d.deaths, now), 1.0)

    def watch(self, stop: threading.Event) -> threading.Thread:
        def run() -> None:
            while not stop.wait(WATCH_S):
                self.check()

        t = threading.Thread(target=run, name="cgpu-mps", daemon=True)
        t.start()
        return t

    def _quit(self, d: _Daemon) -> None:
        try:
            self.command(d.gpu, "quit")
        except MpsError as e:
            self._log.error("MPS control daemon did not take quit", gpu=d.gpu.index, error=str(e))
        deadline = time.monotonic() + QUIT_WAIT_S
        while d.pid and _pid_alive(d.pid) and not self._dead(d) and time.monotonic() < deadline:
            time.sleep(0.02)
        if d.pid and not self._dead(d):
            self._log.error("MPS control daemon killed: it did not quit", gpu=d.gpu.index, pid=d.pid)
            os.kill(d.pid, 9)

    def stop(self, force: bool = False) -> None:
        """Quit the daemons whose server has no client (all with `force`)
        and give their GPUs their compute mode back; the others stay for
        their clients and the next cgpud."""
        with self._lock:
            running = [d for d in self._daemons if d.pid and not self._dead(d)]
            counts: dict[int, int | None] = {}
            for d in running:
                try:
                    counts[d.gpu.index] = 0 if force else self.clients(d.gpu)
                except MpsError as e:
                    self._log.error("MPS clients not known: daemon kept", gpu=d.gpu.index, error=str(e))
                    counts[d.gpu.index] = None
            going = set(to_quit(counts))
            for d in self._daemons:
                if d in running and d.gpu.index not in going:
                    self._log.info(
                        "MPS control daemon kept for its clients", gpu=d.gpu.index, clients=counts[d.gpu.index]
                    )
                    continue
                if d in running:
                    self._quit(d)
                try:
                    self._restore_mode(d.gpu)
                except MpsError as e:
                    self._log.error("compute mode not restored", gpu=d.gpu.index, error=str(e))
                if d.pidfd >= 0:
                    os.close(d.pidfd)
                d.pid, d.pidfd = 0, -1
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass  # not initialised, or nothing left to release
