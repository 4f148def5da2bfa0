"""The VMM attack (create/reserve/map/release of 512 MiB chunks) as a real
tenant under `cgpuctl run --mem 1GiB`: held to the limit as the simulated
GPU counts resident memory, and the memory back after the last unmap."""
from __future__ import annotations

from tests.daemonproc import BIN
from tests.integration.simrun import sim_stat
from tests.intercept.test_memory_lifetime import Phased, build_attacker, check_vmm_sequence


def test_vmm_sequence_under_cgpuctl_run_is_held_to_the_limit(daemon, native, sim_env, tmp_path):
    attacker = build_attacker(tmp_path)
    go = tmp_path / "go"
    go.mkdir()
    run = Phased([str(BIN / "cgpuctl"), "--socket", str(daemon.socket), "run", "--mem", "1GiB", "--",
                  str(attacker), "vmm"], daemon.env, go_dir=go)
    check_vmm_sequence(run, lambda: int(sim_stat(native, sim_env)["gpus"][0]["used"]))
