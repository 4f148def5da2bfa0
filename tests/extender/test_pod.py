"""pod.py: a pod's GPU demand from the v1.Pod JSON kube-scheduler sends."""

from __future__ import annotations

import pytest

from cgpud.extender.pod import GIB, ContainerDemand, PodError, pod_demand
from tests.harness.extender_nodes import container, pod


def test_one_container_memory_only() -> None:
    d = pod_demand(pod("a", [container("c", mem="4")], uid="u1", namespace="ns"))
    assert (d.uid, d.namespace, d.name, d.key) == ("u1", "ns", "a", "ns/a")
    assert d.containers == (ContainerDemand("c", 4, 0, 1, 0),)
    assert d.containers[0].memory_per_gpu == 4 * GIB
    assert d.memory_gib == 4


def test_memory_core_count_and_per_gpu_split() -> None:
    d = pod_demand(pod(containers=[container("c", mem="8", core="30", count="2")]))
    c = d.containers[0]
    assert (c.memory_gib, c.core_percent, c.gpu_count, c.memory_per_gpu) == (8, 30, 2, 4 * GIB)
    assert d.shape == ((4 * GIB, 30, 2),)


def test_numbers_and_suffixed_quantities_are_read() -> None:
    d = pod_demand(pod(containers=[container("c", mem=6, core=10.0, count="1")]))
    assert (d.containers[0].memory_gib, d.containers[0].core_percent) == (6, 10)
    assert pod_demand(pod(containers=[container("c", mem="1k")])).containers[0].memory_gib == 1000


def test_requests_are_read_when_no_limits() -> None:
    d = pod_demand(pod(containers=[container("c", mem="3", where="requests")]))
    assert d.containers[0].memory_gib == 3


def test_limits_win_over_requests() -> None:
    c = {"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "5"}, "requests": {"aliyun.com/gpu-mem": "2"}}}
    assert pod_demand(pod(containers=[c])).containers[0].memory_gib == 5


def test_non_gpu_containers_are_skipped_and_index_counts_all_regular_containers() -> None:
    d = pod_demand(pod(containers=[container("side"), container("a", mem="2"), container("b", mem="3")]))
    assert [(c.name, c.index) for c in d.containers] == [("a", 1), ("b", 2)]


def test_pod_without_gpu_share_has_no_containers() -> None:
    d = pod_demand(pod(containers=[{"name": "c", "resources": {"limits": {"cpu": "1", "nvidia.com/gpu": "1"}}}]))
    assert d.containers == ()


def test_namespace_defaults() -> None:
    p = pod()
    del p["metadata"]["namespace"]
    assert pod_demand(p).namespace == "default"


def test_single_init_gpu_container_is_placed_like_one() -> None:
    d = pod_demand(pod(containers=[container("main")], init=[container("init", mem="2")]))
    assert d.containers == (ContainerDemand("init", 2, 0, 1, -1),)
    assert d.containers[0].init


def test_init_gpu_container_beside_another_gpu_container_is_refused() -> None:
    with pytest.raises(PodError, match="init container init asks for aliyun.com/gpu-mem beside 1 other GPU"):
        pod_demand(pod(containers=[container("main", mem="2")], init=[container("init", mem="2")]))


@pytest.mark.parametrize(
    "value, words",
    [
        ("1.5", "is not a whole number"),
        ("500m", "is not a whole number"),
        ("-2", "is negative"),
        ("lots", "is not a quantity"),
        (True, "is not a quantity"),
        ([4], "is not a quantity"),
        (2.5, "is not a whole number"),
    ],
)
def test_bad_memory_quantities(value: object, words: str) -> None:
    with pytest.raises(PodError, match=f"container c: aliyun.com/gpu-mem = .* {words}"):
        pod_demand(pod(containers=[container("c", mem=value)]))


@pytest.mark.parametrize("core", ["7", "105", "101"])
def test_core_must_be_a_multiple_of_5_up_to_100(core: str) -> None:
    with pytest.raises(PodError, match=f"asks for {core}% compute: ask for a multiple of 5 from 5 to 100"):
        pod_demand(pod(containers=[container("c", mem="2", core=core)]))


def test_memory_must_split_evenly_over_the_gpus() -> None:
    with pytest.raises(PodError, match="asks for 5 GiB on 2 GPUs.*multiple of 2"):
        pod_demand(pod(containers=[container("c", mem="5", count="2")]))


def test_zero_count_is_refused() -> None:
    with pytest.raises(PodError, match="asks for 0 GPUs: ask for 1 or more"):
        pod_demand(pod(containers=[container("c", mem="4", count="0")]))


@pytest.mark.parametrize("kwargs, what", [({"core": "30"}, "gpu-core.percentage"), ({"count": "2"}, "gpu-count")])
def test_core_or_count_without_memory_is_refused(kwargs: dict[str, str], what: str) -> None:
    with pytest.raises(PodError, match=f"asks for aliyun.com/{what} but no aliyun.com/gpu-mem"):
        pod_demand(pod(containers=[container("c", **kwargs)]))


@pytest.mark.parametrize(
    "bad, words",
    [
        ([], "Pod is list, not a v1.Pod"),
        ({"spec": {}}, "no metadata"),
        ({"metadata": {}}, "no metadata.name"),
        ({"metadata": {"name": "p"}}, "has no spec"),
        ({"metadata": {"name": "p"}, "spec": {"containers": {}}}, "spec.containers is not a list"),
        ({"metadata": {"name": "p"}, "spec": {"containers": [3]}}, r"spec.containers\[0\] is not an object"),
        (
            {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "resources": {"limits": []}}]}},
            "resources.limits is not an object",
        ),
    ],
)
def test_wrong_shapes_say_what(bad: object, words: str) -> None:
    with pytest.raises(PodError, match=words):
        pod_demand(bad)


def _whole_container(name: str, n: object, **more: object) -> dict:
    return {"name": name, "image": "x", "resources": {"limits": {"aliyun.com/gpu": n, **more}}}


def test_whole_gpus_are_a_demand_of_their_own() -> None:
    d = pod_demand(pod(containers=[_whole_container("train", "4")]))
    assert d.whole and d.containers == (ContainerDemand("train", 0, 0, 4, 0, whole=True),)


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        (
            [_whole_container("c", 2, **{"aliyun.com/gpu-mem": 4})],
            "asks for 2 whole GPUs (aliyun.com/gpu) and for a GPU share",
        ),
        (
            [_whole_container("a", 1), container("b", mem="2")],
            "asks for whole GPUs (aliyun.com/gpu) in one container and a GPU share (aliyun.com/gpu-mem) in another",
        ),
    ],
)
def test_whole_gpus_and_shares_do_not_mix(containers: list, message: str) -> None:
    with pytest.raises(PodError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pod_demand(pod(containers=containers))
