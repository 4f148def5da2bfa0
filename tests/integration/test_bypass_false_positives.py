"""No false alarms: 20 well-behaved tenants for 60 s under the bypass
watchdog produce no event.

A real cgpud in core_mem mode on two simulated 80 GiB GPUs (GPU 0 under
the fixed policy, GPU 1 under soft, which lends idle time), the watchdog at
0.2 s (300 rounds) with the default 512 MiB slack. The simulated driver
charges every process 300 MiB of context memory on each GPU it uses
(`context_mib`), which NVML shows and libcgpu does not count, as on a real
GPU. Each tenant is `cgpuctl run --mem M -- cgpu-burn` allocating right up
to its limit through libcgpu; eight of them also run kernels back to back
under a compute share, two without a share (memory-only instances, which
run on what the shares leave). The last step is a control: a tenant with LD_PRELOAD
removed is reported on the same cgpud, so the quiet minute was watched.

Slow by nature (about 70 s); it runs with the rest of the suite."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cgpud.native import native_path
from tests.harness.bypass_watch import MIB, Nvml, Tenant, bypass_events, run_tenant, wait_events, watch_flags
from tests.harness.daemon import running_daemon
from tests.harness.wait import until
import pytest

pytestmark = pytest.mark.slow  # tens of seconds to minutes each

CONTEXT_MIB = 300
SECONDS = 60.0
# (limit in MiB, compute share, runs kernels): 10 memory-only holding memory,
# 2 memory-only running kernels (under fixed they get what no share
# reserves, under soft what is idle), 8 with a share running kernels.
TENANTS = (
    [(512, 0, False), (1024, 0, False), (1536, 0, False), (2048, 0, False), (768, 0, False)] * 2
    + [(1024, 0, True)] * 2
    + [(1024, 10, True), (512, 15, True), (2048, 20, True), (1024, 25, True)] * 2
)


def burn(limit_mib: int, kernels: bool) -> list[str]:
    cmd = [str(native_path("bin/cgpu-burn")), "--alloc", f"{limit_mib}MiB", "--require-alloc"]
    if kernels:
        return [*cmd, "--kernel-ns", "200000", "--streams", "2", "--duration", "600"]
    return [*cmd, "--hold", "600"]


def test_twenty_well_behaved_tenants_for_60_s_make_no_event(tmp_path: Path, native: Path) -> None:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    conf = tmp_path / "sim.conf"
    conf.write_text(f"context_mib={CONTEXT_MIB}\n" + 'gpu name="NVIDIA H100 80GB HBM3" mem=80GiB sms=132\n' * 2)
    env.update(
        LD_LIBRARY_PATH=str(native / "sim"), CGPU_SIM_CONFIG=str(conf), CGPU_SIM_STATE=str(tmp_path / "sim.state")
    )
    nvml = Nvml(env)
    tenants: list[Tenant] = []
    with running_daemon(
        tmp_path,
        env,
        "--mode",
        "core_mem",
        "--placement",
        "spread",
        "--compute-policy",
        "3",
        "--gpu-compute-policy",
        "1=4",
        *watch_flags("report"),
    ) as d:
        try:
            for limit, core, kernels in TENANTS:
                tenants.append(run_tenant(d, f"{limit}MiB", burn(limit, kernels), tmp_path, core=core))
            expected = {t.pid: (limit + CONTEXT_MIB) * MIB for t, (limit, _, _) in zip(tenants, TENANTS)}

            def off_limits() -> dict[int, tuple[int | None, int]]:
                """Tenants NVML does not show at their limit plus their context."""
                procs = {**nvml.query(0)["procs"], **nvml.query(1)["procs"]}
                return {pid: (procs.get(pid), used) for pid, used in expected.items() if procs.get(pid) != used}

            until(
                lambda: not off_limits(),
                timeout=60,
                interval=0.1,
                what="NVML to show every tenant at its limit plus its context",
                explain=lambda: f"{off_limits()}",
            )
            start = time.monotonic()
            while time.monotonic() - start < SECONDS:
                events = bypass_events(d)
                assert events == [], events
                dead = [t.errors() for t in tenants if not t.alive()]
                assert not dead, dead
                time.sleep(1.0)
            assert bypass_events(d) == []
            assert off_limits() == {}
            # The compute rule had data: NVML holds utilisation samples of every tenant running kernels.
            sm = {**nvml.query(0)["sm"], **nvml.query(1)["sm"]}
            busy = [t.pid for t, (_, _, kernels) in zip(tenants, TENANTS) if kernels]
            assert all(sm.get(pid, 0) > 0 for pid in busy), (busy, sm)
            # The control: a tenant going around libcgpu on the same cgpud is seen.
            control = run_tenant(d, "1", ["env", "-u", "LD_PRELOAD", *burn(2048, False)], tmp_path)
            tenants.append(control)
            [event] = wait_events(d, lambda e: True, 10, "the control tenant's event")
            assert event["instance_id"] == control.instance_id and event["kind"] == "memory_over_limit", event
        finally:
            for t in tenants:
                t.stop()
            nvml.close()
