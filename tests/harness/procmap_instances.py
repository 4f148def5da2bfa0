"""Instances as procmap meets them, for the tests that map processes to
instances over a fake /proc and over real processes: a container's, found
by its init process, and a `cgpuctl run` one, found by its pids; one grant
of 1 GiB on GPU 0 each (procmap never looks at grants)."""

from __future__ import annotations

import time

from cgpud.node.model import GIB, Grant, Instance, InstanceState, Owner, OwnerKind
from cgpud.node.procmap import ProcessMapper


def container_instance(iid: str, init: int, updated: float | None = None) -> Instance:
    """A bound container instance whose init process is `init`, updated now unless given."""
    return Instance(
        iid,
        Owner(OwnerKind.CONTAINER, f"{iid}@/bundles/{iid}"),
        (Grant(0, "GPU-0", GIB, 0),),
        InstanceState.BOUND,
        True,
        pids=(init,),
        updated=time.time() if updated is None else updated,
        holder=f"{iid}@/bundles/{iid}",
    )


def run_instance(
    iid: str, pids: tuple[int, ...], updated: float | None = None, state: InstanceState = InstanceState.BOUND
) -> Instance:
    """A `cgpuctl run` instance holding `pids`, updated now unless given."""
    return Instance(
        iid,
        Owner(OwnerKind.PROCESS, f"cgpuctl-run-test-{pids[0]}"),
        (Grant(0, "GPU-0", GIB, 0),),
        state,
        True,
        pids=pids,
        updated=time.time() if updated is None else updated,
    )


def owners(mapper: ProcessMapper, pids: list[int], instances: list[Instance]) -> dict[int, str | None]:
    """Each pid's instance id as the mapper identifies it, None for no instance."""
    return {pid: i.instance_id for pid, i in mapper.identify(pids, instances).items()}
