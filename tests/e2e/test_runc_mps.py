"""A container on an mps node, run by real runc through the shim: cgpud in
mps mode gives it the GPU's MPS pipe directory (read-only) and the MPS
variables, the simulated driver inside connects to the GPU's control daemon
through that mount, and the container's share holds as MPS gives it,
measured on the host from the simulated GPU's own accounting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cgpud.native import native_path
from tests.harness.daemon import running_daemon
from tests.harness.oci import Host, run
from tests.harness.sharerun import Sampler
from tests.harness.workload import burn_json, env_lines

pytestmark = pytest.mark.timing  # measures a compute share

BURN = "cgpu-burn --kernel-ns 200000 --streams 4 --duration 3"


def test_a_30_percent_container_is_an_mps_client_at_30_percent(tmp_path: Path, host: Host) -> None:
    env = dict(host.sim_env, PATH=f"{native_path('sim')}:{os.environ['PATH']}")  # nvidia-cuda-mps-control
    with running_daemon(tmp_path, env, "--mode", "mps") as d:
        b = host.bundle(
            tmp_path / "core30",
            ["sh", "-c", f"env; ls /tmp/nvidia-mps; touch /tmp/nvidia-mps/x 2>/dev/null || echo READONLY; {BURN}"],
            ("ALIYUN_COM_GPU_MEM_CONTAINER=2", "ALIYUN_COM_GPU_CORE_PERCENTAGE=30"),
        )
        sampler = Sampler(host.sim_env, 50)
        try:
            out = run(host, b, host.new_id(), shim=True, relay=d.relay)
        finally:
            sampler.stop()
        assert out.returncode == 0, out.stderr
        assert burn_json(out.stdout)["errors"] == []
        seen = env_lines(out.stdout)
        assert seen["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        assert seen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert seen["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
        lines = out.stdout.splitlines()
        assert "control" in lines and "READONLY" in lines  # the daemon's socket, in a read-only mount
        s = sampler.samples
        started = next(x for x in s if x[1] > s[0][1])
        lo = next(x for x in s if x[0] >= started[0] + 500_000_000)
        hi = next(x for x in s if x[0] >= lo[0] + 2_000_000_000)
        share = 100.0 * (hi[1] - lo[1]) / (hi[0] - lo[0])
        print(f"a 30 % container on an mps node: {share:.1f} % of the GPU")
        assert abs(share - 30) <= 5, share
        # It was the daemon's client: the server it started serves on.
        assert "NEW CLIENT" in (d.socket.parent / "mps" / "0" / "log" / "control.log").read_text()
