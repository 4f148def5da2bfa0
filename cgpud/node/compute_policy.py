"""Compute policy decisions, pure: which nodes schedule compute, which
policy each GPU runs after `cgpuctl policy set`, and the stored form."""

from __future__ import annotations

from dataclasses import replace

from cgpud.node.model import ComputePolicy, NodeMode, NodePolicy
from cgpud.errors import UsageError


def limits_compute(mode: NodeMode) -> bool:
    """Only core_mem nodes schedule compute; on the others every gate stays
    open whatever the compute policy says."""
    return mode is NodeMode.CORE_MEM


def with_compute_policy(node: NodePolicy, policy: ComputePolicy, gpu: int | None, gpus: int) -> NodePolicy:
    """The node's policy after `policy set`: for one GPU, or for the whole
    node (which drops every per-GPU policy)."""
    if gpu is None:
        return replace(node, compute_policy=policy, gpu_compute_policies=())
    if not 0 <= gpu < gpus:
        raise UsageError(f"no GPU {gpu} on this node (it has GPUs 0 to {gpus - 1})")
    overrides = dict(node.gpu_compute_policies)
    overrides[gpu] = policy
    kept = tuple(sorted((g, p) for g, p in overrides.items() if p is not node.compute_policy))
    return replace(node, gpu_compute_policies=kept)


def encode_compute_policies(node: NodePolicy) -> str:
    """The stored form: the node's policy, then gpu=policy pairs ("3 1=5")."""
    return " ".join([str(int(node.compute_policy)), *(f"{g}={int(p)}" for g, p in node.gpu_compute_policies)])


def decode_compute_policies(node: NodePolicy, text: str) -> NodePolicy:
    """The node policy with the stored (or configured) compute policies in it."""
    try:
        first, *pairs = text.split()
        overrides = tuple(sorted((int(g), ComputePolicy(int(p))) for g, p in (x.split("=") for x in pairs)))
        return replace(node, compute_policy=ComputePolicy(int(first)), gpu_compute_policies=overrides)
    except ValueError as e:
        raise UsageError(
            f"compute policies {text!r} are not valid: the node's policy, then GPU=POLICY pairs "
            f'such as "3 1=5", policies 0-5'
        ) from e
