"""A compute share inside a real runc container: the gate is read through the
read-only /run/cgpu mount and the share holds, measured on the host from the
simulated GPU's own accounting (busy time of the whole GPU: the container's
pids live in another namespace)."""

from __future__ import annotations

import mmap
import subprocess
import time
from pathlib import Path

import pytest

from cgpud._region import ffi, lib
from cgpud.native import native_path
from tests.harness.daemon import make_daemon, running_daemon
from tests.harness.oci import Host, run, runtime_env
from tests.harness.workload import burn_json, instances
from tests.harness.freeze import freeze_with_gate_closed
from tests.harness.sharerun import Sampler
from tests.harness.wait import until

pytestmark = pytest.mark.timing  # measures compute shares and hand-over times

BURN = "cgpu-burn --kernel-ns 200000 --streams 4 --duration 3"


def _busy_percent(sampler: Sampler) -> float:
    """GPU busy share over 2 s, from 0.5 s after the GPU started working."""
    s = sampler.samples
    started = next(x for x in s if x[1] > s[0][1])
    lo = next(x for x in s if x[0] >= started[0] + 500_000_000)
    hi = next(x for x in s if x[0] >= lo[0] + 2_000_000_000)
    return 100.0 * (hi[1] - lo[1]) / (hi[0] - lo[0])


def test_a_30_percent_container_alone_under_fixed_gets_30_percent(tmp_path: Path, host: Host) -> None:
    with running_daemon(tmp_path, host.sim_env, "--mode", "core_mem", "--compute-policy", "3") as d:
        shares = {}
        for name, extra in (("core30", ("ALIYUN_COM_GPU_CORE_PERCENTAGE=30",)), ("memory-only", ())):
            b = host.bundle(tmp_path / name, ["sh", "-c", BURN], ("ALIYUN_COM_GPU_MEM_CONTAINER=2", *extra))
            sampler = Sampler(host.sim_env, 50)
            try:
                out = run(host, b, host.new_id(), shim=True, relay=d.relay)
            finally:
                sampler.stop()
            assert out.returncode == 0, out.stderr  # cgpu-burn exits 1 on any CUDA error
            assert burn_json(out.stdout)["errors"] == []
            shares[name] = _busy_percent(sampler)
        assert abs(shares["core30"] - 30) <= 5, shares
        # The gate comes from the share: a memory-only instance alone gets
        # the unreserved rest, which is all of it.
        assert shares["memory-only"] >= 90, shares
        assert instances(d) == []


def _grants_of_the_one_instance(state: Path, timeout: float = 60) -> Path:
    def grants() -> Path | None:
        found = [p for p in state.rglob("grants") if p.is_file()]
        assert len(found) <= 1, found
        return found[0] if found else None

    return until(grants, timeout=timeout, interval=0.02, what=f"an instance region under {state}")


def test_a_container_at_a_closed_gate_finishes_when_cgpud_is_killed(tmp_path: Path, host: Host) -> None:
    """kill -9 of cgpud, stopped at a moment the 30 % container's gate was
    closed: nobody will open it, yet the container's launches go on within
    the probe interval and it finishes; its work alone takes about 0.6 s."""
    d = make_daemon(tmp_path, host.sim_env, "--mode", "core_mem", "--compute-policy", "3")
    d.start()
    burn = "cgpu-burn --kernel-ns 1000000 --streams 2 --launches 600"
    b = host.bundle(
        tmp_path / "core30", ["sh", "-c", burn], ("ALIYUN_COM_GPU_MEM_CONTAINER=2", "ALIYUN_COM_GPU_CORE_PERCENTAGE=30")
    )
    cid = host.new_id()
    proc = subprocess.Popen(
        [str(native_path("bin/cgpu-runtime")), "--root", str(host.runc_root), "run", "--bundle", str(b.path), cid],
        env=runtime_env(d.relay),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        grants = _grants_of_the_one_instance(d.state)
        with open(grants, "rb") as f:
            m = mmap.mmap(f.fileno(), ffi.sizeof("struct cgpu_grants"), mmap.MAP_SHARED, mmap.PROT_READ)
        view = ffi.from_buffer("struct cgpu_grants *", m)

        def opened() -> int:
            assert proc.poll() is None, "the container ended before its gate opened"
            return int(view.device[0].gate & lib.CGPU_GATE_OPEN)  # noqa: F821 (called before the del below)

        # Scheduled: opened at least once. No sleep between looks: the gate opens for a slice at a time.
        until(opened, timeout=60, interval=0, what="the container's gate to open")
        assert d.proc
        freeze_with_gate_closed(d.proc.pid, lambda: int(view.device[0].gate))  # noqa: F821 (called before the del below)
        d.kill()
        killed = time.monotonic()
        assert not view.device[0].gate & lib.CGPU_GATE_OPEN
        # Generous: the work is 0.6 s, the probe interval 0.2 s; a hang is forever.
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
        assert view.device[0].gate & lib.CGPU_GATE_OPEN == 0  # nobody opened it
        del view
        m.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        subprocess.run(["runc", "--root", str(host.runc_root), "delete", "--force", cid], capture_output=True)
    assert burn_json(out)["errors"] == [] and burn_json(out)["launches"] == 600, (out, err)
    assert "compute scheduler (cgpud) is gone" in out + err
    assert took < 30, took
