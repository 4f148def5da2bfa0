"""The VMM attack (create/reserve/map/release of 512 MiB chunks) as a real
tenant under `cgpuctl run --mem 1GiB`: held to the limit as the simulated
GPU counts resident memory, and the memory back after the last unmap; and
every attack of the tenant program clean under ASan and UBSan."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.harness.daemon import BIN
from tests.harness.simrun import sim_stat
from tests.harness.memory_attack import Phased, build_attacker, check_vmm_sequence

pytestmark = pytest.mark.slow  # tens of seconds to minutes each


def test_vmm_sequence_under_cgpuctl_run_is_held_to_the_limit(daemon, native, sim_env, tmp_path):
    attacker = build_attacker(tmp_path)
    go = tmp_path / "go"
    go.mkdir()
    run = Phased(
        [str(BIN / "cgpuctl"), "--socket", str(daemon.socket), "run", "--mem", "1GiB", "--", str(attacker), "vmm"],
        daemon.env,
        go_dir=go,
    )
    check_vmm_sequence(run, lambda: int(sim_stat(native, sim_env)["gpus"][0]["used"]))


@pytest.mark.parametrize("mode", ["vmm", "retain", "export", "graph", "limits", "oldabi"])
def test_memory_attacks_are_clean_under_sanitizers(san_native, san_instance, tmp_path, mode):
    """Every path of the attacker through the sanitized libcgpu.so and the
    sanitized simulated driver (a 2 GiB instance here)."""
    proc = subprocess.run(
        [str(build_attacker(tmp_path)), mode],
        env=san_instance,
        input="go\n" * 5,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert reports, proc.stdout
    if mode == "vmm":
        assert reports[0]["creates"] == ["CUDA_SUCCESS"] * 4 + ["CUDA_ERROR_OUT_OF_MEMORY"] * 4
