"""GPU containers on older kernels: cgpud, cgpu-runtime, runc, cgpu-hook
and the tenant all run under tests/harness/old_kernel.py's seccomp filter,
which answers ENOSYS to each system call the kernel named lacks. Without
pidfd_open cgpud learns of a container's exit from its sweep instead of at
once; everything else is as on a new kernel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.model import GIB
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.old_kernel import KERNELS, OldKernel, launcher
from tests.harness.oci import Host, create, run, runc
from tests.harness.wait import until
from tests.harness.workload import BURN, assert_2gib_granted, burn_json, instances


@pytest.fixture(scope="module")
def old_kernel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launcher(tmp_path_factory)


@pytest.fixture(params=KERNELS, ids=lambda k: k.name)
def kernel(request: pytest.FixtureRequest) -> OldKernel:
    return request.param


@pytest.fixture
def old_cgpud(tmp_path: Path, gpu_env: dict[str, str], old_kernel: Path, kernel: OldKernel) -> Iterator[Daemon]:
    with running_daemon(tmp_path, gpu_env, wrapper=kernel.argv(old_kernel)) as d:
        yield d
    assert "Traceback" not in d.log.read_text()


def test_the_filter_plays_the_kernel(old_kernel: Path, kernel: OldKernel) -> None:
    """The launcher really takes the calls away (else the tests below prove nothing)."""
    probe = "import os\ntry:\n    os.pidfd_open(os.getpid())\nexcept OSError as e:\n    print(e.errno)"
    out = subprocess.run(kernel.argv(old_kernel, "python3", "-c", probe), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "38"  # ENOSYS


def test_a_container_gets_its_limit_and_is_released_at_its_end(
    tmp_path: Path, host: Host, old_cgpud: Daemon, old_kernel: Path, kernel: OldKernel
) -> None:
    b = host.bundle(tmp_path / "b", ["sh", "-c", f"env; {BURN}"], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
    out = run(host, b, host.new_id(), shim=True, relay=old_cgpud.relay, wrapper=kernel.argv(old_kernel))
    assert out.returncode == 0, out.stderr
    assert_2gib_granted(out.stdout)
    # No pidfd: the sweep (every 0.2 s here) finds the exit, not the moment runc returns.
    until(lambda: instances(old_cgpud) == [], 10, what="the instance released by the sweep")


def test_a_container_whose_init_is_killed_is_released_by_the_sweep(
    tmp_path: Path, host: Host, old_cgpud: Daemon, old_kernel: Path, kernel: OldKernel
) -> None:
    wrapper = kernel.argv(old_kernel)
    first = host.bundle(tmp_path / "first", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
    assert run(host, first, host.new_id(), shim=True, relay=old_cgpud.relay, wrapper=wrapper).returncode == 0
    b = host.bundle(tmp_path / "b", ["sh", "-c", f"{BURN}; exec sleep 600"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
    cid = host.new_id()
    code, log = create(host, b, cid, old_cgpud.relay, pid_file=b.path / "pid", wrapper=wrapper)
    assert code == 0, log
    try:
        assert runc(host, "start", cid, shim=True, relay=old_cgpud.relay, wrapper=wrapper).returncode == 0
        until(lambda: '"device"' in (b.path / "stdio.log").read_text(), 30, what="the container's cgpu-burn report")
        assert burn_json((b.path / "stdio.log").read_text())["alloc"]["until_fail_bytes"] == GIB
        [inst] = instances(old_cgpud)
        assert inst["state"] == "bound"
        os.kill(json.loads(runc(host, "state", cid).stdout)["pid"], signal.SIGKILL)
        until(lambda: instances(old_cgpud) == [], 10, what="the instance released after its init died")
    finally:
        runc(host, "delete", "--force", cid, shim=True, relay=old_cgpud.relay, wrapper=wrapper)
    log = old_cgpud.log.read_text()
    assert log.count("this kernel has no pidfd_open") == 1, log  # said once, not at each of the two containers
    assert "cannot watch the init process" not in log, log
