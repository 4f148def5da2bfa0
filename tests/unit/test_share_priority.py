"""A pod's compute weight and high priority: cgpud.kube.share_priority's
decisions, and the pod fields cgpud.kube.apiserver reads them from."""

from __future__ import annotations

import pytest

from cgpud.errors import UsageError
from cgpud.kube.apiserver import ApiServerError, ContainerInfo, PodInfo, pod_info
from cgpud.kube.share_priority import SharePriority, granted, requested


def pod(priority: int = 0, annotations: dict[str, str] | None = None, **env: str) -> PodInfo:
    return PodInfo(
        "uid-1",
        "ns",
        "p",
        annotations=annotations or {},
        containers=(ContainerInfo("main", {}, env=env), ContainerInfo("side", {})),
        priority=priority,
    )


def test_nothing_asked_is_weight_1_normal_priority_at_any_pod_priority() -> None:
    assert granted(pod(-5), "main", 1) == SharePriority(1, 0)


def test_env_wins_over_the_annotation_for_its_container_only() -> None:
    p = pod(10, {"cgpu.io/gpu-weight": "7"}, ALIYUN_COM_GPU_SCHD_WEIGHT="2")
    assert requested(p, "main") == SharePriority(2, 0)
    assert requested(p, "side") == SharePriority(7, 0)


@pytest.mark.parametrize("flag", ["0", "false", "no", ""])
def test_high_priority_off_asks_nothing(flag: str) -> None:
    assert granted(pod(0, ALIYUN_COM_GPU_HIGH_PRIO=flag), "main", 1) == SharePriority(1, 0)


def test_the_minimum_is_inclusive_and_the_refusal_names_both_numbers() -> None:
    p = pod(5, {"cgpu.io/gpu-high-priority": "1", "cgpu.io/gpu-weight": "3"})
    assert granted(p, "main", 5) == SharePriority(3, 1)
    with pytest.raises(UsageError, match=r"weight 3 and high priority, but the pod's priority \(5\) is below .* \(6\)"):
        granted(p, "main", 6)


def test_a_bad_annotation_is_named() -> None:
    with pytest.raises(UsageError, match=r"cgpu\.io/gpu-weight=0 is out of range: use 1 to 100"):
        requested(pod(10, {"cgpu.io/gpu-weight": "0"}), "main")


def test_the_api_server_pod_gives_priority_and_only_our_env() -> None:
    raw = {
        "metadata": {"uid": "u", "namespace": "ns", "name": "p"},
        "spec": {
            "priority": 1000,
            "containers": [
                {
                    "name": "main",
                    "env": [
                        {"name": "PATH", "value": "/bin"},
                        {"name": "ALIYUN_COM_GPU_SCHD_WEIGHT", "value": "4"},
                        {"name": "ALIYUN_COM_GPU_HIGH_PRIO", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                    ],
                }
            ],
        },
    }
    info = pod_info(raw)
    assert info.priority == 1000
    assert dict(info.containers[0].env) == {
        "ALIYUN_COM_GPU_SCHD_WEIGHT": "4",
        "ALIYUN_COM_GPU_HIGH_PRIO": "\0valueFrom",
    }
    with pytest.raises(UsageError, match="must be a literal value"):
        requested(info, "main")


@pytest.mark.parametrize("bad", ["1000", 1.5, True])
def test_a_priority_that_is_not_an_integer_is_an_api_server_error(bad: object) -> None:
    with pytest.raises(ApiServerError, match=r"pod ns/p: spec.priority = .* is not an integer"):
        pod_info({"metadata": {"namespace": "ns", "name": "p"}, "spec": {"priority": bad}})
