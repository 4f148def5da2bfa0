"""What every check shares: the private working directory, the programs
built for this run, the machine's description, bounded subprocesses and
cgpud started on the machine's own NVML and driver.

Nothing here knows what GPU is underneath: the driver and NVML are whatever
`libcuda.so.1` and `libnvidia-ml.so.1` the dynamic loader finds in the
environment the check was started with."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from bench.gpu_check.model import CheckError
from tests.harness.sim import region_mounts

BIN = Path(sys.executable).parent
LOG = structlog.get_logger("gpu-check")


@dataclass(frozen=True)
class Tools:
    """The workload programs, each reused from the repository."""

    burn: Path  # cgpu-burn: driver API only (csrc/tools/cgpu_burn.c)
    bypass: Path  # cgpu-bypass: allocates around libcgpu (csrc/tools/cgpu_bypass.c)
    spin: Path  # tests/cuda/spin.cu built by the PyPI nvcc: the CUDA runtime
    calls: Path  # bench/intercept_calls.c: per-call cost of driver entry points
    libcgpu: Path
    runtime: Path  # cgpu-runtime, the OCI runtime shim


@dataclass(frozen=True)
class Options:
    quick: bool
    mem_gib: int
    hami: Path | None
    only: frozenset[str]


def run(
    argv: Sequence[str], env: dict[str, str], timeout: float, what: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`argv` to its end within `timeout` seconds (killed past it, with
    everything it started in its process group)."""
    done = _run_once(argv, env, timeout, what)
    if check and done.returncode != 0:
        tail = " | ".join((done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-3:])
        raise CheckError(f"{what}: exit {done.returncode}: {tail}")
    return done


def _run_once(argv: Sequence[str], env: dict[str, str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.Popen(
            list(argv),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as e:
        raise CheckError(f"{what}: cannot start {argv[0]}: {e}") from e
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        raise CheckError(f"{what}: did not finish within {timeout:.0f} s: {shlex.join(argv)}") from None
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group `proc` leads (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def unmount_regions(under: Path) -> list[str]:
    """Detaches what cgpud keeps mounted across its own restarts (its
    instances' tmpfs, a reserved instance's too) under `under`; the mount
    points it could not detach."""
    from cgpud._region import lib

    return [p for p in region_mounts(under) if lib.cgpu_region_unmount(p.encode()) != 0]


def json_line(out: str, what: str, starts: str = "{") -> dict[str, Any]:
    """The last line of `out` that is a JSON object."""
    for line in reversed(out.splitlines()):
        if line.startswith(starts):
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise CheckError(f"{what}: unreadable JSON line {line[:200]!r}: {e}") from e
            if isinstance(value, dict):
                return value
    raise CheckError(f"{what}: no JSON object in its output: {out[-300:]!r}")


def steps(out: str) -> dict[str, list[str]]:
    """spin.cu's reports ("<step> <cudaError> [values]"), first of each step."""
    got: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, *rest = line.split()
        got.setdefault(name, rest)
        got[name + "@last"] = rest
    return got


class Cgpud:
    """One cgpud on this machine's GPUs, its state, sockets and log in `dir`."""

    def __init__(self, dir: Path, env: dict[str, str], flags: Sequence[str]) -> None:
        self.dir = dir
        self.env = env
        self.socket = dir / "run" / "cgpud.sock"
        self.relay = dir / "run" / "relay.sock"
        self.log = dir / "cgpud.log"
        self.flags = list(flags)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "empty.toml").write_text("")
        notify_path = self.dir / "notify"
        notify_path.unlink(missing_ok=True)  # left by the start before a kill (kill, then start again)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        argv = [
            str(BIN / "cgpud"),
            "--config",
            str(self.dir / "empty.toml"),
            "--state-dir",
            str(self.dir / "state"),
            "--socket",
            str(self.socket),
            "--relay-socket",
            str(self.relay),
            "--cdi-dir",
            str(self.dir / "cdi"),
            "--sweep-interval",
            "0.2",
            *self.flags,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=dict(self.env, NOTIFY_SOCKET=str(notify_path)), stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise CheckError(f"cgpud {' '.join(self.flags)} exited {self.proc.returncode}: {self.log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckError(
                        f"cgpud {' '.join(self.flags)} not ready within {timeout:.0f} s: {self.log_tail()}"
                    )
                notify.settimeout(min(left, 0.5))
                try:
                    if b"READY=1" in notify.recv(4096):
                        break
                except TimeoutError:
                    continue
            # ready is answering: the first request is the one a busy host delays
            self.cgpuctl("list", timeout=max(5.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        finally:
            notify.close()

    def log_tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-3:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as a crash: its instances, gates and tmpfs stay for its
        next start."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL past `timeout` (the MPS and compute mode
        restore is cgpud's own stop, so it gets its time); then its
        instances' tmpfs mounts detached."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                LOG.warning("cgpud did not stop on SIGTERM: killed", log=str(self.log))
                kill_group(self.proc)
                self.proc.wait()
        # cgpud keeps its instances' tmpfs for its next start: this one has none
        left = unmount_regions(self.dir)
        if left:
            LOG.error("region mounts not detached", mounts=left)

    def cgpuctl_argv(self, *args: str) -> list[str]:
        return [str(BIN / "cgpuctl"), "--socket", str(self.socket), *args]

    def cgpuctl(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(self.cgpuctl_argv(*args), self.env, timeout, f"cgpuctl {' '.join(args)}", check=check)

    def run_argv(self, mem: str, *command: str, core: int | None = None) -> list[str]:
        share = ["--core", str(core)] if core is not None else []
        return self.cgpuctl_argv("run", "--mem", mem, *share, "--", *command)


@dataclass
class Rig:
    """The run's shared parts; `work` is the run's temporary directory."""

    work: Path
    env: dict[str, str]
    tools: Tools
    options: Options
    machine: dict[str, Any]

    def seconds(self, quick: float, full: float) -> float:
        return quick if self.options.quick else full

    @contextmanager
    def cgpud(self, name: str, *flags: str) -> Iterator[Cgpud]:
        """A cgpud for one check, stopped when the block ends however it ends."""
        d = Cgpud(self.work / "cgpud" / name, self.env, flags)
        d.start()
        try:
            yield d
        finally:
            d.stop()

    def run(
        self, argv: Sequence[str], timeout: float, what: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return run(argv, env or self.env, timeout, what, check)

    def burn(
        self,
        args: Sequence[str],
        timeout: float,
        what: str,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """cgpu-burn's report (exit 0 or 3: an allocation refused is a result here)."""
        done = self.run([*prefix, str(self.tools.burn), *args], timeout, what, check=False, env=env)
        if done.returncode not in (0, 3):
            tail = " | ".join((done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-3:])
            raise CheckError(f"{what}: cgpu-burn exit {done.returncode}: {tail}")
        return json_line(done.stdout, what, '{"device"')
