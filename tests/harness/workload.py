"""What a workload in a container prints (cgpu-burn's report, its environment)
and the instances cgpud lists for it, read and checked the same way by every
end-to-end test."""

from __future__ import annotations

import json
from pathlib import Path

from cgpud.node.model import GIB
from tests.harness.daemon import Daemon


BURN = "cgpu-burn --alloc-until-fail 512MiB"


def burn_json(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith('{"device"'))
    return json.loads(line)


def env_lines(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line and not line.startswith("{"))


def assert_2gib_granted(stdout: str) -> None:
    """What a container asking for 2 GiB on a 16 GiB simulated GPU prints
    with `env; cgpu-burn`: the limit as total, allocation stopped there with
    the driver's own error, and cgpud's outputs in its environment."""
    burn = burn_json(stdout)
    assert burn["mem_total_reported"] == 2 * GIB
    assert burn["alloc"]["until_fail_bytes"] == 2 * GIB
    assert burn["alloc"]["until_fail_result"] == "CUDA_ERROR_OUT_OF_MEMORY"
    env = env_lines(stdout)
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
    assert env["ALIYUN_COM_GPU_MEM_DEV"] == "16"
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert env["ALIYUN_COM_GPU_MEM_POD"] == "2"
    assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")


# What a tenant tries against cgpu's read-only mounts and a neighbour's
# region; each attempt prints its word only if it got through.
BREAKOUT_WORDS = ("WROTE-LIMITS", "WROTE-GRANTS", "REMOUNTED", "WROTE-LIB", "WROTE-PRELOAD", "SEES-OTHER")


def breakout_script(other_region: Path) -> str:
    """A shell line that tries every write in BREAKOUT_WORDS, then lists its
    own /run/cgpu and prints its uid."""
    return "; ".join(
        [
            "echo x > /run/cgpu/limits && echo WROTE-LIMITS",
            "echo x > /run/cgpu/grants && echo WROTE-GRANTS",
            "mount -o remount,rw /run/cgpu 2>/dev/null && echo REMOUNTED",
            "echo x > /usr/local/cgpu/libcgpu.so && echo WROTE-LIB",
            "echo x > /etc/ld.so.preload && echo WROTE-PRELOAD",
            f"ls {other_region} 2>/dev/null && echo SEES-OTHER",
            "ls /run/cgpu",
            "id -u",
        ]
    )


def assert_no_breakout(stdout: str, uid: str) -> None:
    """breakout_script's output when every attempt failed, run as uid."""
    for bad in BREAKOUT_WORDS:
        assert bad not in stdout, stdout
    assert stdout.split() == ["grants", "limits", "usage", uid]


def instances(cgpud: Daemon, all_: bool = False) -> list[dict]:
    out = cgpud.cgpuctl("list", *(["--all"] if all_ else []), "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
