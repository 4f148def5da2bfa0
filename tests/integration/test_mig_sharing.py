"""cgpud on a machine with GPUs in MIG mode, in cgpu mode, as a host user
meets it through cgpuctl: a share lands on the GPU outside MIG mode, and on
a machine whose GPUs are all in MIG mode it is refused in one line that
says what to ask for instead, with nothing made (docs/modes.md, "MIG")."""

from __future__ import annotations

import json

from tests.harness.daemon import make_daemon
from tests.harness.sim import sim_env_in


def _instances(daemon) -> list[dict]:
    out = daemon.cgpuctl("list", "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_share_goes_to_the_gpu_outside_mig_mode(tmp_path, native):
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=7g.80gb"])
    daemon = make_daemon(tmp_path, env, "--mode", "cgpu")
    daemon.start()
    try:
        # Inside: the share's only CUDA device is GPU 1 with the 4 GiB limit.
        run = daemon.cgpuctl("run", "--mem", "4", "--", "cgpu-burn", "--alloc-until-fail=1GiB")
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["mem_total_reported"] == 4 << 30 and out["alloc"]["until_fail_count"] == 4
    finally:
        daemon.stop()


def test_a_machine_all_in_mig_mode_refuses_a_share_in_one_line(tmp_path, native):
    env = sim_env_in(tmp_path / "sim", native, mem="80GiB", placements=["mig=3g.40gb,3g.40gb"] * 2)
    daemon = make_daemon(tmp_path, env, "--mode", "cgpu")
    daemon.start()
    try:
        run = daemon.cgpuctl("run", "--mem", "4", "--", "true")
        assert run.returncode != 0 and run.stderr.count("\n") == 1, run.stderr
        assert "every GPU of this node is in MIG mode" in run.stderr
        assert "nvidia.com/mig-<profile>" in run.stderr
        assert _instances(daemon) == []
    finally:
        daemon.stop()
