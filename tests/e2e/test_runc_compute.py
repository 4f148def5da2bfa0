"""A compute share inside a real runc container: the gate is read through the
read-only /run/cgpu mount and the share holds, measured on the host from the
simulated GPU's own accounting (busy time of the whole GPU: the container's
pids live in another namespace)."""
from __future__ import annotations

from pathlib import Path

from tests.daemonproc import make_daemon
from tests.e2e.oci import Host, run
from tests.e2e.test_runc import burn_json, instances
from tests.sharerun import Sampler

BURN = "cgpu-burn --kernel-ns 200000 --streams 4 --duration 3"


def _busy_percent(sampler: Sampler) -> float:
    """GPU busy share over 2 s, from 0.5 s after the GPU started working."""
    s = sampler.samples
    started = next(x for x in s if x[1] > s[0][1])
    lo = next(x for x in s if x[0] >= started[0] + 500_000_000)
    hi = next(x for x in s if x[0] >= lo[0] + 2_000_000_000)
    return 100.0 * (hi[1] - lo[1]) / (hi[0] - lo[0])


def test_a_30_percent_container_alone_under_fixed_gets_30_percent(tmp_path: Path, host: Host) -> None:
    d = make_daemon(tmp_path, host.sim_env, "--mode", "core_mem", "--compute-policy", "3")
    d.start()
    try:
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
    finally:
        d.stop()
