"""`cgpuctl policy set` for the node or one GPU, and the stored form."""

from __future__ import annotations

import pytest

from cgpud.node.compute_policy import decode_compute_policies, encode_compute_policies, with_compute_policy
from cgpud.node.model import ComputePolicy as P
from cgpud.node.model import NodePolicy
from cgpud.errors import UsageError


def test_one_gpu_differs_and_setting_the_node_drops_every_difference() -> None:
    node = NodePolicy(compute_policy=P.FIXED)
    one = with_compute_policy(node, P.NATIVE, 1, gpus=4)
    assert [one.policy_for(g) for g in range(4)] == [P.FIXED, P.NATIVE, P.FIXED, P.FIXED]
    back = with_compute_policy(one, P.FIXED, 1, gpus=4)
    assert back.gpu_compute_policies == ()  # the same as the node's: no override kept
    whole = with_compute_policy(one, P.SOFT, None, gpus=4)
    assert [whole.policy_for(g) for g in range(4)] == [P.SOFT] * 4


def test_a_gpu_the_node_lacks_is_refused() -> None:
    with pytest.raises(UsageError, match="no GPU 2 on this node \\(it has GPUs 0 to 1\\)"):
        with_compute_policy(NodePolicy(), P.FIXED, 2, gpus=2)


@pytest.mark.parametrize("text", ["3", "3 1=5", "0 0=1 3=4"])
def test_the_stored_form_round_trips(text: str) -> None:
    node = decode_compute_policies(NodePolicy(), text)
    assert encode_compute_policies(node) == text


@pytest.mark.parametrize("text", ["", "fixed", "3 1", "3 1=9", "9", "3 x=1"])
def test_damaged_policies_are_refused(text: str) -> None:
    with pytest.raises(UsageError, match="are not valid"):
        decode_compute_policies(NodePolicy(), text)
