"""MPS's pure decisions (cgpud/node/mps.py) and what they put in a
container's edits on an mps node."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgpud.containers.edits import apply_edits, instance_edits
from cgpud.errors import UsageError
from cgpud.node.model import GIB, GpuCapacity, Grant, Instance, InstanceState, NodeMode, NodePolicy, Owner, OwnerKind
from cgpud.node.model import Request
from cgpud.node.mps import (
    CONTAINER_PIPE,
    RESTART_BURST,
    RESTART_MAX_DELAY_S,
    client_env,
    daemon_env,
    mps_pipe,
    pipe_dir,
    restart_delay,
    to_quit,
)
from cgpud.node.placement import admit
from tests.harness.lifecycle import INSTALLED_FILES as FILES, INSTALLED_REGIONS as REGIONS

ROOT = Path("/run/cgpud/mps")
OWNER = Owner(OwnerKind.CONTAINER, "c1")


def inst(*grants: tuple[int, int, int], enforced: bool = True) -> Instance:
    return Instance(
        "i1",
        OWNER,
        tuple(Grant(g, f"GPU-{g}", mem * GIB, core) for g, mem, core in grants),
        InstanceState.BOUND,
        enforced,
    )


def test_client_env_from_the_core_share_and_memory() -> None:
    assert client_env(30, 4 * GIB) == {
        "CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
    }
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in client_env(0, GIB)  # no share: the server's 100 %


def test_daemon_env_names_its_gpu_and_drops_cgpuds_own_mps_settings() -> None:
    env = daemon_env(
        {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "5"}, ROOT, 2, "GPU-a"
    )
    assert env == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "GPU-a",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/cgpud/mps/2/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/run/cgpud/mps/2/log",
    }


def test_restart_at_once_then_back_off() -> None:
    assert restart_delay([], 100.0) == 0.0
    burst = [90.0 + i for i in range(RESTART_BURST)]
    assert restart_delay(burst, 100.0) == 0.0
    assert restart_delay([*burst, 99.5], 100.0) == pytest.approx(0.5)  # one past the burst: 1 s after it died
    assert restart_delay([*burst, 95.0, 96.0, 99.0], 100.0) == pytest.approx(3.0)  # 4 s after
    many = [99.0] * 40
    assert restart_delay(many, 100.0) == pytest.approx(RESTART_MAX_DELAY_S - 1)
    assert restart_delay([1.0] * 40, 100.0) == 0.0  # long ago: forgotten


def test_stop_quits_only_daemons_without_clients() -> None:
    assert to_quit({0: 0, 1: 2, 2: None}) == [0]


def test_one_gpu_instances_get_their_gpus_pipe() -> None:
    pipes = {0: pipe_dir(ROOT, 0), 1: pipe_dir(ROOT, 1)}
    assert mps_pipe(inst((1, 4, 30)), pipes) == pipes[1]
    assert mps_pipe(inst((0, 4, 0), (1, 4, 0)), pipes) is None
    assert mps_pipe(inst((1, 4, 30)), {}) is None


def test_edits_mount_the_pipe_read_only_and_set_the_variables() -> None:
    pipes = {0: pipe_dir(ROOT, 0)}
    i = inst((0, 4, 30))
    edits = instance_edits(i, REGIONS / i.id, {0: 16 * GIB}, FILES, mps_pipes=pipes)
    env = dict(edits.env)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == CONTAINER_PIPE
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    pipe = [m for m in edits.mounts if m.destination == CONTAINER_PIPE]
    assert len(pipe) == 1 and pipe[0].source == str(pipes[0]) and pipe[0].read_only
    # The image's own values are replaced, not kept beside ours.
    spec = {
        "process": {"env": ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", "CUDA_MPS_PIPE_DIRECTORY=/elsewhere"]},
        "mounts": [],
    }
    out = apply_edits(spec, edits, FILES)
    assert [e for e in out["process"]["env"] if e.startswith("CUDA_MPS_")] == [
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
    ]


def test_no_mps_edits_off_mps_or_without_enforcement() -> None:
    i = inst((0, 4, 0))
    plain = instance_edits(i, REGIONS / i.id, {0: 16 * GIB}, FILES)
    assert not any(k.startswith("CUDA_MPS_") for k, _ in plain.env)
    assert all(m.destination != CONTAINER_PIPE for m in plain.mounts)
    share = inst((0, 4, 0), enforced=False)
    edits = instance_edits(share, REGIONS / i.id, {0: 16 * GIB}, FILES, mps_pipes={0: pipe_dir(ROOT, 0)})
    assert not any(k.startswith("CUDA_MPS_") for k, _ in edits.env)


TWO = (GpuCapacity(0, "GPU-0", 16 * GIB), GpuCapacity(1, "GPU-1", 16 * GIB))
MPS = NodePolicy(mode=NodeMode.MPS)


def test_mps_admits_a_core_share_on_one_gpu_and_counts_it() -> None:
    first = admit(Request(OWNER, 4 * GIB, core_percent=70), TWO, [], MPS)
    assert first[0].core_percent == 70
    held = [Instance("a", OWNER, tuple(first), InstanceState.BOUND, True)]
    second = admit(Request(OWNER, 4 * GIB, core_percent=40), TWO, held, MPS)
    assert second[0].gpu_index != first[0].gpu_index  # 70 + 40 does not fit one GPU


def test_mps_refuses_several_gpus_per_container() -> None:
    with pytest.raises(UsageError, match="runs one MPS control daemon per GPU"):
        admit(Request(OWNER, 4 * GIB, gpu_count=2), TWO, [], MPS)
