"""`cgpuctl run`: a host process under a fresh instance, with libcgpu.so
preloaded, released when the process exits. If cgpuctl itself is killed,
or cgpud is away when the process exits, the daemon releases the instance
once it finds the processes (bound by PID) gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from cgpud.cli.client import LocalClient
from cgpud.contract import REGION_ENV
from cgpud.node.model import Instance, Owner, OwnerKind, Request
from cgpud.errors import CgpuError, DaemonUnreachable, UsageError
from cgpud.containers.edits import application_env
from cgpud.native import native_path
from cgpud.node.mps import PIPE_ENV, client_env


def instance_environment(
    instance: Instance, region: Path, gpu_memory: dict[int, int], base: dict[str, str], mps_pipe: Path | None = None
) -> dict[str, str]:
    """What the process sees: the library and its region, only its GPUs, and
    the ALIYUN_COM_GPU_MEM_* variables cGPU applications read (outputs for
    them, never inputs to enforcement); on an mps node the MPS variables,
    with the GPU's pipe directory where the host has it."""
    env = dict(base)
    if instance.enforced:
        lib = str(native_path("lib/libcgpu.so"))
        env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
        env[REGION_ENV] = str(region)
    env.update(application_env(instance, gpu_memory))
    # No container runtime narrows a host process's view: the driver must.
    env["CUDA_VISIBLE_DEVICES"] = env["NVIDIA_VISIBLE_DEVICES"]
    if mps_pipe is not None:
        grant = instance.grants[0]
        env.update(client_env(grant.core_percent, grant.memory))
        env[PIPE_ENV] = str(mps_pipe)
    return env


def owner() -> Owner:
    """The owner of this cgpuctl run's instance: this process, on this host."""
    return Owner(OwnerKind.PROCESS, f"cgpuctl-run-{socket.gethostname()}-{os.getpid()}")


def run(
    socket_path: Path,
    request: Request,
    command: Sequence[str],
    wait: float = 0.0,
    notice: Callable[[str], None] | None = None,
) -> int:
    """Runs `command` under a fresh instance made for `request` (owned by
    owner()); waits up to `wait` seconds for a cgpud that is down
    (LocalClient), so a tenant started during a restart starts after it."""
    if not command:
        raise UsageError("nothing to run: give the command after --, e.g. cgpuctl run --mem 4GiB -- python train.py")
    with LocalClient(socket_path, wait=wait, notice=notice) as client:
        instance = client.create(request, pid=os.getpid())
        try:
            region = client.region_dir(instance.id)
            if region is None:  # released already: there is no region to run under
                raise CgpuError(f"instance {instance.id} was released before {command[0]} could start")
            gpu_memory = {g.gpu.index: g.gpu.memory for g in client.node_info().gpus}
            mps_pipe = client.mps_pipe_dir(instance.id)
            env = instance_environment(instance, region, gpu_memory, dict(os.environ), mps_pipe)
            try:
                child = subprocess.Popen(list(command), env=env)
            except OSError as e:
                raise UsageError(f"cannot run {command[0]}: {e.strerror}") from e
            # Both PIDs: the instance lives while either does, so neither a
            # killed cgpuctl nor a fast-exiting child releases it early.
            client.bind(instance.id, (os.getpid(), child.pid))

            # Ctrl-C and TERM go to the child; we wait for it either way.
            def forward(signum: int, _frame: FrameType | None) -> None:
                child.send_signal(signum)

            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, forward)
            code = child.wait()
        finally:
            _release_at_exit(client, instance.id, notice)
    return code if code >= 0 else 128 - code


def _release_at_exit(client: LocalClient, instance_id: str, notice: Callable[[str], None] | None) -> None:
    """Releases once, without waiting for a cgpud that is away: this process
    and its child are about to be gone, and cgpud releases an instance whose
    processes are gone when it is back. Waiting would only hold the exit."""
    client.wait = 0.0
    try:
        client.release(instance_id)
    except DaemonUnreachable as e:
        if notice is not None:
            notice(f"{e}; cgpud releases instance {instance_id} once it is back")
