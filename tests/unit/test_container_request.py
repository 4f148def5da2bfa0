"""Reading a container's GPU request from its OCI spec, and the spec edits
that give it its instance: pure functions, checked rule by rule."""

from __future__ import annotations

from typing import Any

import pytest

from cgpud.node.model import GIB, Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.errors import UsageError
from cgpud.containers.edits import CONTAINER_LIBRARY, PRELOAD, apply_edits, instance_edits
from cgpud.containers.request import Claim, EnvRequest, read_request
from tests.harness.lifecycle import INSTALLED_FILES as FILES, INSTALLED_REGIONS as REGIONS


def spec(*env: str, mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "ociVersion": "1.0.2",
        "process": {"args": ["sh"], "env": ["PATH=/bin", *env]},
        "root": {"path": "rootfs"},
        "mounts": mounts or [{"destination": "/proc", "type": "proc", "source": "proc"}],
    }


def ask(s: dict[str, Any], trust_env: bool = True) -> EnvRequest | Claim | None:
    return read_request(s, trust_env=trust_env, regions=REGIONS)


def test_no_request_is_none() -> None:
    assert ask(spec("HOME=/", "NVIDIA_VISIBLE_DEVICES=all")) is None
    assert ask({"ociVersion": "1.0.2"}) is None


def test_env_request_all_fields() -> None:
    got = ask(
        spec(
            "ALIYUN_COM_GPU_MEM_CONTAINER=2",
            "ALIYUN_COM_GPU_CORE_PERCENTAGE=30",
            "ALIYUN_COM_GPU_COUNT=2",
            "ALIYUN_COM_GPU_SCHD_WEIGHT=3",
            "ALIYUN_COM_GPU_HIGH_PRIO=true",
        )
    )
    assert got == EnvRequest(memory_gib=2, gpu_count=2, core_percent=30, weight=3, priority=1)


def test_env_request_defaults() -> None:
    assert ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER= 4 ")) == EnvRequest(memory_gib=4)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("ALIYUN_COM_GPU_MEM_CONTAINER=0", r"ALIYUN_COM_GPU_MEM_CONTAINER=0 is out of range: use 1 to"),
        ("ALIYUN_COM_GPU_MEM_CONTAINER=two", r"ALIYUN_COM_GPU_MEM_CONTAINER='two' is not a whole number of GiB"),
        ("ALIYUN_COM_GPU_MEM_CONTAINER=1.5", r"not a whole number of GiB: set it to e.g. 2"),
        ("ALIYUN_COM_GPU_MEM_CONTAINER=-1", r"not a whole number"),
        (
            "ALIYUN_COM_GPU_CORE_PERCENTAGE=30",
            r"ALIYUN_COM_GPU_CORE_PERCENTAGE is set but ALIYUN_COM_GPU_MEM_CONTAINER is not",
        ),
    ],
)
def test_bad_env_values(env: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ask(spec(env))


def test_core_over_100_and_bad_flag() -> None:
    with pytest.raises(UsageError, match="ALIYUN_COM_GPU_CORE_PERCENTAGE=101 is out of range: use 0 to 100 percent"):
        ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=101"))
    with pytest.raises(UsageError, match="ALIYUN_COM_GPU_HIGH_PRIO='maybe' is not a yes/no value"):
        ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_HIGH_PRIO=maybe"))


def test_duplicate_request_variable_is_refused() -> None:
    with pytest.raises(UsageError, match=r"ALIYUN_COM_GPU_MEM_CONTAINER is set twice \('1' and '8'\)"):
        ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_MEM_CONTAINER=8"))


def test_disable_and_visible_devices() -> None:
    assert ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER=1", "CGPU_DISABLE=true")) is None
    with pytest.raises(UsageError, match="ALIYUN_COM_GPU_VISIBLE_DEVICES is not supported"):
        ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_VISIBLE_DEVICES=0"))


def test_untrusted_env_is_not_read_at_all() -> None:
    assert ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER=2"), trust_env=False) is None
    assert ask(spec("ALIYUN_COM_GPU_MEM_CONTAINER=nonsense"), trust_env=False) is None


def region_mount(source: str, dest: str = "/run/cgpu") -> dict[str, Any]:
    return {"destination": dest, "type": "bind", "source": source, "options": ["rbind", "ro"]}


def test_claim_by_region_mount_wins_and_works_untrusted() -> None:
    s = spec("ALIYUN_COM_GPU_MEM_CONTAINER=2", mounts=[region_mount(f"{REGIONS}/cgpu-0123abcd")])
    assert ask(s) == Claim("cgpu-0123abcd")
    assert ask(s, trust_env=False) == Claim("cgpu-0123abcd")


@pytest.mark.parametrize(
    "source",
    ["/tmp/fake-region", f"{REGIONS}/../../../tmp/x", f"{REGIONS}", "relative/path", f"{REGIONS}/cgpu-0123abcd\n"],
)
def test_foreign_mount_at_run_cgpu_is_refused(source: str) -> None:
    with pytest.raises(UsageError, match="is not a cgpu instance: /run/cgpu is reserved for cgpu"):
        ask(spec(mounts=[region_mount(source)]), trust_env=False)


def test_foreign_mount_under_run_cgpu_is_refused() -> None:
    with pytest.raises(UsageError, match="a mount at /run/cgpu/limits from '/tmp/limits' is not a cgpu instance"):
        ask(spec(mounts=[region_mount("/tmp/limits", "/run/cgpu/limits")]))


def test_two_claims_are_refused() -> None:
    s = spec(mounts=[region_mount(f"{REGIONS}/a"), region_mount(f"{REGIONS}/b/usage", "/run/cgpu/usage")])
    with pytest.raises(UsageError, match="mounts two cgpu instances"):
        ask(s)


# ---------------------------------------------------------------- edits


def instance(enforced: bool = True, core: int = 0) -> Instance:
    grants = (Grant(1, "GPU-b", 2 * GIB, core),)
    return Instance("cgpu-0000aaaa", Owner(OwnerKind.CONTAINER, "c1"), grants, InstanceState.RESERVED, enforced)


GPU_MEMORY = {0: 16 * GIB, 1: 16 * GIB - 1}


def edited(inst: Instance, base: dict[str, Any] | None = None) -> dict[str, Any]:
    edits = instance_edits(inst, REGIONS / inst.id, GPU_MEMORY, FILES)
    return apply_edits(base or spec("ALIYUN_COM_GPU_MEM_CONTAINER=2", "NVIDIA_VISIBLE_DEVICES=all"), edits, FILES)


def env_of(s: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in s["process"]["env"])


def test_edits_env_for_applications() -> None:
    env = env_of(edited(instance(core=30)))
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2" and env["ALIYUN_COM_GPU_MEM_POD"] == "2"
    assert env["ALIYUN_COM_GPU_MEM_DEV"] == "15"  # rounded down, as ACK shows it
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-b"  # replaces the user's "all"
    assert env["ALIYUN_COM_GPU_CORE_PERCENTAGE"] == "30"
    assert env["PATH"] == "/bin"


def test_edits_mount_only_daemon_files() -> None:
    s = edited(instance())
    mounts = {m["destination"]: m for m in s["mounts"]}
    assert mounts["/run/cgpu"]["source"] == f"{REGIONS}/cgpu-0000aaaa" and "ro" in mounts["/run/cgpu"]["options"]
    assert mounts["/run/cgpu/usage"]["source"] == f"{REGIONS}/cgpu-0000aaaa/usage"
    assert "rw" in mounts["/run/cgpu/usage"]["options"]
    assert mounts[CONTAINER_LIBRARY]["source"] == str(FILES.library) and "ro" in mounts[CONTAINER_LIBRARY]["options"]
    assert "noexec" not in mounts[CONTAINER_LIBRARY]["options"]  # it is mapped executable
    assert mounts[PRELOAD]["source"] == str(FILES.preload) and "ro" in mounts[PRELOAD]["options"]
    assert all("nosuid" in m["options"] for m in s["mounts"] if m["type"] == "bind")
    assert s["mounts"][0]["destination"] == "/proc"  # ours go last, the rest keep their order


def test_edits_hooks_carry_env_timeout_and_instance() -> None:
    hooks = edited(instance())["hooks"]
    assert set(hooks) == {"createRuntime"}  # no poststop: cgpud sees the init exit itself
    for stage in ("createRuntime",):
        (h,) = hooks[stage]
        assert h["path"] == str(FILES.hook)
        assert h["args"] == ["cgpu-hook", "--socket", "/run/cgpud/relay.sock", "--instance", "cgpu-0000aaaa", stage]
        assert h["env"] == ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"] and h["timeout"] > 0


def test_share_mode_gets_env_and_hooks_but_no_library() -> None:
    s = edited(instance(enforced=False))
    assert [m["destination"] for m in s["mounts"]] == ["/proc"]
    assert env_of(s)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2"
    assert set(s["hooks"]) == {"createRuntime"}


def test_edits_are_idempotent_and_keep_user_hooks() -> None:
    base = spec("ALIYUN_COM_GPU_MEM_CONTAINER=2")
    base["hooks"] = {"poststop": [{"path": "/usr/bin/user-hook"}]}
    once = edited(instance(), base)
    twice = edited(instance(), once)
    assert once == twice
    assert once["hooks"]["poststop"][0] == {"path": "/usr/bin/user-hook"}
    assert base["hooks"] == {"poststop": [{"path": "/usr/bin/user-hook"}]}  # input untouched


def test_user_mount_over_our_targets_is_replaced() -> None:
    base = spec(
        "ALIYUN_COM_GPU_MEM_CONTAINER=2",
        mounts=[{"destination": "/etc/ld.so.preload", "type": "bind", "source": "/tmp/evil"}],
    )
    s = edited(instance(), base)
    assert [m["source"] for m in s["mounts"] if m["destination"] == PRELOAD] == [str(FILES.preload)]


def test_without_toolkit_devices_sets_every_copy_to_void_and_leaves_the_rest():
    from cgpud.containers.request import without_toolkit_devices

    spec = {
        "process": {
            "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all", "X=1", "NVIDIA_VISIBLE_DEVICES=0,1"],
            "args": ["sh"],
        },
        "root": {"path": "rootfs"},
    }
    got = without_toolkit_devices(spec)
    assert got == {
        "process": {
            "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=void", "X=1", "NVIDIA_VISIBLE_DEVICES=void"],
            "args": ["sh"],
        },
        "root": {"path": "rootfs"},
    }
    assert spec["process"]["env"][1] == "NVIDIA_VISIBLE_DEVICES=all"  # the caller's spec is not changed
    for quiet in (
        {"process": {"env": ["PATH=/bin"]}},
        {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}},
        {"process": {}},
        {},
        {"process": {"env": "NVIDIA_VISIBLE_DEVICES=all"}},
    ):
        assert without_toolkit_devices(quiet) is None, quiet
