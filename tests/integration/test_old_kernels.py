"""cgpud, cgpuctl, libcgpu and a tenant on older kernels: every process runs
under tests/harness/old_kernel.py's seccomp filter, which answers ENOSYS to
each system call the kernel named lacks, as that kernel would."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cgpud.native import native_path
from cgpud.node.model import GIB
from tests.harness.daemon import running_daemon
from tests.harness.old_kernel import KERNELS, OldKernel, launcher
from tests.harness.wait import until


@pytest.fixture(scope="module")
def old_kernel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launcher(tmp_path_factory)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_a_tenant_is_held_to_its_limit_and_released_at_its_exit(
    tmp_path: Path, sim_env: dict[str, str], old_kernel: Path, kernel: OldKernel
) -> None:
    with running_daemon(tmp_path, sim_env, wrapper=kernel.argv(old_kernel)) as d:
        burn = kernel.argv(
            old_kernel,
            *d.cgpuctl_argv(
                "run",
                "--mem",
                "1GiB",
                "--",
                str(native_path("bin/cgpu-burn")),
                *[a for _ in range(3) for a in ("--alloc", "1GiB")],
            ),
        )
        proc = subprocess.run(burn, env=d.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.splitlines()[-1])
        assert report["alloc"]["results"] == ["CUDA_SUCCESS"] + ["CUDA_ERROR_OUT_OF_MEMORY"] * 2
        assert report["mem_total_reported"] == GIB
        until(
            lambda: json.loads(d.cgpuctl("list", "--output", "json").stdout) == [],
            10,
            what="the tenant's instance released after its exit",
        )
    log = d.log.read_text()
    assert "Traceback" not in log, log


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_kill_mode_kills_a_bypassing_tenant_without_a_pidfd(
    tmp_path: Path, sim_env: dict[str, str], old_kernel: Path, kernel: OldKernel
) -> None:
    """Without pidfd_open the kill re-checks the process and uses kill(2)."""
    flags = ("--bypass-interval", "0.2", "--bypass-action", "kill")
    with running_daemon(tmp_path, sim_env, *flags, wrapper=kernel.argv(old_kernel)) as d:
        # 3 GiB in a 1 GiB instance, libcgpu not preloaded.
        tenant = d.start_cgpuctl(
            "run", "--mem", "1", "--", "env", "-u", "LD_PRELOAD", "cgpu-burn", "--alloc", "3GiB", "--require-alloc",
            "--hold", "60", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        out, err = tenant.communicate(timeout=60)
    assert tenant.returncode == 128 + 9, (out, err)  # cgpuctl run: its child died of SIGKILL
    killed = [
        e
        for e in map(json.loads, filter(lambda line: line.startswith("{"), d.log.read_text().splitlines()))
        if e.get("event") == "bypass" and e.get("action") == "killed"
    ]
    assert killed and "no pidfd on this kernel" in json.dumps(killed[0]), killed
