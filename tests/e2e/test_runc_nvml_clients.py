"""nvitop and gpustat inside a real runc container of 1 GiB, through
cgpu-runtime and a real cgpud, beside a tenant outside it on the same GPU:
they show the container's 1 GiB and its own process only. The container
gets the test's Python, its venv (where both tools are installed) and the
host's shared libraries read-only; the driver libraries are the ones the
toolkit would mount (tests/harness/oci.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cgpud.native import native_path
from tests.harness.daemon import Daemon
from tests.harness.oci import Host, runtime_env
from tests.harness.nvml_clients import burner, check_inside, inside_argv

VENV = Path(sys.prefix)
PYTHON_HOME = Path(sys.base_prefix)


def _ro(path: Path, source: Path | None = None) -> dict[str, object]:
    return {"destination": str(path), "type": "bind", "source": str(source or path), "options": ["rbind", "ro"]}


def test_nvitop_and_gpustat_in_a_1gib_container_show_it_alone(
    tmp_path: Path, host: Host, cgpud: Daemon, native: Path
) -> None:
    b = host.bundle(
        tmp_path / "b",
        inside_argv(str(VENV / "bin/python"), "/usr/bin/cgpu-burn"),
        ("ALIYUN_COM_GPU_MEM_CONTAINER=1", "HOME=/tmp"),
    )
    b.spec["mounts"] += [
        _ro(VENV),
        _ro(PYTHON_HOME),
        # Python's extension modules need more than the template's libraries.
        _ro(Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu")),
    ]
    b.write()
    cid = host.new_id()
    with burner(host.sim_env, native, "2GiB") as neighbour:
        proc = subprocess.run(
            [str(native_path("bin/cgpu-runtime")), "--root", str(host.runc_root), "run", "--bundle", str(b.path), cid],
            env=runtime_env(cgpud.relay),
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        subprocess.run(["runc", "--root", str(host.runc_root), "delete", "--force", cid], capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_inside(proc.stdout, neighbour.pid)
