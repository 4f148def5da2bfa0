"""The VMM attack (create/reserve/map/release of 512 MiB chunks) from inside
a real runc container of 1 GiB, through cgpu-runtime and a real cgpud: held
to the limit as the simulated GPU counts resident memory, and the memory
back after the last unmap."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from cgpud.native import native_path
from tests.harness.daemon import Daemon
from tests.harness.oci import Host, runtime_env
from tests.harness.simrun import sim_stat
from tests.harness.memory_attack import Phased, build_attacker, check_vmm_sequence


def test_vmm_sequence_in_a_1gib_container_is_held_to_the_limit(
    tmp_path: Path, host: Host, cgpud: Daemon, native: Path
) -> None:
    b = host.bundle(
        tmp_path / "b", ["/usr/bin/memory_attack", "vmm"], ("ALIYUN_COM_GPU_MEM_CONTAINER=1", "GO_DIR=/tmp/go")
    )
    attacker = build_attacker(tmp_path)
    (b.rootfs / "usr/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(attacker, b.rootfs / "usr/bin/memory_attack")
    go = b.rootfs / "tmp/go"
    go.mkdir(parents=True)
    go.chmod(0o777)
    cid = host.new_id()
    run = Phased(
        [str(native_path("bin/cgpu-runtime")), "--root", str(host.runc_root), "run", "--bundle", str(b.path), cid],
        runtime_env(cgpud.relay),
        go_dir=go,
    )
    try:
        check_vmm_sequence(run, lambda: int(sim_stat(native, host.sim_env)["gpus"][0]["used"]))
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()
        subprocess.run(["runc", "--root", str(host.runc_root), "delete", "--force", cid], capture_output=True)
