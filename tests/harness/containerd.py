"""A private containerd for a test, configured for cgpu by cgpuctl, with ctr."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.daemon import BIN, Daemon
from tests.harness.oci import HOOK_ENV_PATH, Host, runtime_env
from tests.harness.wait import until


@dataclass
class Containerd:
    config: Path
    address: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "--address", str(self.address), *args], capture_output=True, text=True, timeout=timeout
        )


def _configure(tmp: Path) -> Path:
    config = tmp / "config.toml"
    config.write_text(
        f'version = 2\nroot = "{tmp}/root"\nstate = "{tmp}/state"\n\n[grpc]\n  address = "{tmp}/containerd.sock"\n'
    )
    out = subprocess.run(
        [str(BIN / "cgpuctl"), "runtime", "configure", "--containerd", "--config", str(config)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return config


def loaded_binary_name(config: Path) -> str:
    dump = subprocess.run(["containerd", "--config", str(config), "config", "dump"], capture_output=True, text=True)
    assert dump.returncode == 0, dump.stderr
    cri = tomllib.loads(dump.stdout)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["cgpu"]
    assert cri["runtime_type"] == "io.containerd.runc.v2"
    return cri["options"]["BinaryName"]


@contextmanager
def running_containerd(tmp_path: Path, cgpud: Daemon) -> Iterator[Containerd]:
    """containerd configured by `cgpuctl runtime configure`, its shims reaching cgpud's relay."""
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        raise AssertionError("install containerd (apt-get install containerd)")
    tmp = tmp_path / "ctd"
    tmp.mkdir()
    config = _configure(tmp)
    log = tmp / "containerd.log"
    # containerd's environment reaches its shims and so cgpu-runtime.
    env = runtime_env(cgpud.relay)
    with open(log, "wb") as out:
        proc = subprocess.Popen(["containerd", "--config", str(config)], env=env, stdout=out, stderr=out)
    c = Containerd(config, tmp / "containerd.sock", proc, log)

    def tail() -> str:
        return f"containerd's log ends:\n{log.read_text()[-3000:]}"

    def answers() -> bool:
        if c.ctr("version").returncode == 0:
            return True
        if proc.poll() is not None:
            raise AssertionError(f"containerd did not start (exit {proc.returncode}): {tail()}")
        return False

    try:  # a containerd that never answers is stopped all the same
        until(answers, timeout=30, interval=0.1, what="containerd to answer `ctr version`", explain=tail)
        yield c
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ctr_run_on_sim(
    c: Containerd,
    host: Host,
    rootfs: Path,
    binary: str,
    env: tuple[str, ...],
    container_id: str,
    *cmd: str,
    namespace: str | None = None,
    run_opts: tuple[str, ...] = ("--rm",),
) -> subprocess.CompletedProcess[str]:
    """`ctr run` through the runc-compatible `binary` (cgpu-runtime, as
    containerd loaded it) of host's rootfs template, hard-linked to rootfs,
    with the simulated device handed in as the NVIDIA toolkit would hand in
    the real one (tests/harness/oci.py) and the hooks' PATH set."""
    subprocess.run(["cp", "-al", str(host.template), str(rootfs)], check=True)
    sim = host.sim_env
    args = ["--namespace", namespace] if namespace else []  # none: ctr's own default
    args += [
        "run",
        *run_opts,
        "--runtime",
        "io.containerd.runc.v2",
        "--runc-binary",
        binary,
        "--rootfs",
        "--mount",
        f"type=bind,src={host.sim_dir},dst={host.sim_dir},options=rbind:rw",
        "--env",
        HOOK_ENV_PATH,
        "--env",
        f"CGPU_SIM_CONFIG={sim['CGPU_SIM_CONFIG']}",
        "--env",
        f"CGPU_SIM_STATE={sim['CGPU_SIM_STATE']}",
    ]
    for e in env:
        args += ["--env", e]
    return c.ctr(*args, str(rootfs), container_id, *cmd)
