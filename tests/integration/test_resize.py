"""Resizing a running instance (`cgpuctl resize`): a real cgpud, a real tenant
under `cgpuctl run` that keeps running through the resize (libcgpu.so
preloaded, the simulated driver beneath), and the node's admission of other
instances before and after."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.cli.client import LocalClient
from cgpud.errors import CgpuError

from tests.harness.cc import compile_strict
from tests.harness.daemon import Daemon, running_daemon
from tests.harness.grants import GIB
from tests.harness.sharerun import Sampler, ShareRig, TenantSpec, busy_percent, start_burn_tenant
from tests.harness.sim import sim_env_in
from tests.harness.simrun import sim_stat

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


class Tenant:
    """tests/intercept/programs/resize_tenant.c under `cgpuctl run`: one
    command, one JSON answer."""

    def __init__(self, d: Daemon, program: Path, mem: str) -> None:
        self.proc = subprocess.Popen(
            d.cgpuctl_argv("run", "--mem", mem, "--", str(program)),
            env=d.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self._answer() == {"ready": True}

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.communicate(timeout=30)[1]
        return json.loads(line)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str) -> dict:
        self.send(command)
        return self._answer()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.ask("free")
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resize")
    return compile_strict(
        out / "resize_tenant",
        f"-I{ROOT / 'csrc/include'}",
        str(ROOT / "tests/intercept/programs/resize_tenant.c"),
        "-ldl",
        "-pthread",
    )


@pytest.fixture
def one_gpu(tmp_path: Path, native: Path) -> Iterator[Daemon]:
    """cgpud (cgpu mode) on one simulated 16 GiB GPU."""
    (tmp_path / "d").mkdir()
    with running_daemon(tmp_path / "d", sim_env_in(tmp_path / "sim", native, gpus=1)) as d:
        yield d


def instance_of(d: Daemon, tenant: Tenant) -> dict:
    listed = json.loads(d.cgpuctl("list", "--output", "json").stdout)
    ours = [i for i in listed if any(p in i["pids"] for p in _tree(tenant.proc.pid))]
    assert len(ours) == 1, listed
    return ours[0]


def _tree(pid: int) -> list[int]:
    import psutil

    proc = psutil.Process(pid)
    return [pid, *(c.pid for c in proc.children(recursive=True))]


def test_a_running_tenant_sees_its_memory_grow_and_shrink(one_gpu: Daemon, program: Path, native: Path) -> None:
    d = one_gpu
    tenant = Tenant(d, program, "1GiB")
    try:
        iid = instance_of(d, tenant)["id"]
        assert tenant.ask("info")["total"] == 1 * GIB
        assert tenant.ask("fill 256") == {"chunks": 4, "held": 1024}

        grow = d.cgpuctl("resize", iid, "--mem", "3GiB")
        assert grow.returncode == 0, grow.stderr
        assert f"resized {iid}: 3 GiB per GPU" in grow.stdout
        # The same process, no restart: the new total, and room to use it.
        info = tenant.ask("info")
        assert info["total"] == 3 * GIB and info["free"] == 2 * GIB, info
        assert tenant.ask("fill 256") == {"chunks": 8, "held": 3072}
        assert sim_stat(native, d.env)["gpus"][0]["used"] >= 3 * GIB

        # Below what it holds: refused with the figure, nothing changed.
        shrink = d.cgpuctl("resize", iid, "--mem", "2GiB")
        assert shrink.returncode != 0
        assert "hold 3 GiB on GPU 0 now" in shrink.stderr and "resize to 3 GiB or more" in shrink.stderr, shrink.stderr
        assert tenant.ask("info")["total"] == 3 * GIB
        assert instance_of(d, tenant)["grants"][0]["memory_bytes"] == 3 * GIB

        assert tenant.ask("free") == {"held": 0}
        shrink = d.cgpuctl("resize", iid, "--mem", "512MiB")
        assert shrink.returncode == 0, shrink.stderr
        assert tenant.ask("info")["total"] == 512 * MIB
        assert tenant.ask("fill 256") == {"chunks": 2, "held": 512}
    finally:
        tenant.stop()


def test_shrinks_racing_allocating_threads_never_leave_it_over_its_limit(
    one_gpu: Daemon, program: Path, native: Path
) -> None:
    """The tenant as an attacker of timing: six threads allocating and
    freeing 256 MiB as fast as they can (millions of calls) while cgpud
    shrinks the instance from 2 GiB to 1 GiB and back, again and again.
    Nothing fails or stalls, every refused shrink says what was held, and
    after every accepted one the GPU (the simulated driver's own count)
    holds at most 1 GiB. The nanosecond window the protocol closes is too
    short to hit from here by chance: tests/unit/test_region.py forces both
    of its interleavings."""
    d = one_gpu
    tenant = Tenant(d, program, "2GiB")
    try:
        iid = instance_of(d, tenant)["id"]
        tenant.send("churn 6 256 6")
        accepted = refused = 0
        worst = 0
        with LocalClient(d.socket) as client:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    client.resize(iid, 1 * GIB, None)
                except CgpuError as e:
                    refused += 1
                    assert "its processes hold" in str(e), e
                    continue
                accepted += 1
                for _ in range(3):
                    worst = max(worst, sim_stat(native, d.env)["gpus"][0]["used"])
                client.resize(iid, 2 * GIB, None)
        churned = tenant._answer()
        print(
            f"\nshrinks accepted {accepted}, refused {refused}; worst held after one {worst / MIB:.0f} MiB; {churned}"
        )
        assert accepted >= 1 and churned["allocs"] > 0, (accepted, refused, churned)
        assert worst <= 1 * GIB, worst
    finally:
        tenant.stop()


def test_admission_follows_a_resize_at_once(one_gpu: Daemon, program: Path) -> None:
    """What one instance gives back, another can take; what it takes, no
    other can; and it cannot grow past what the GPU has free."""
    d = one_gpu
    tenant = Tenant(d, program, "4GiB")
    try:
        iid = instance_of(d, tenant)["id"]
        big = d.cgpuctl("resize", iid, "--mem", "14GiB")
        assert big.returncode == 0, big.stderr
        refused = d.cgpuctl("create", "--mem", "4GiB")
        assert refused.returncode != 0 and "most free is 2 GiB on GPU 0" in refused.stderr, refused.stderr

        # Past the GPU: refused, and what stands is unchanged.
        other = d.cgpuctl("create", "--mem", "2GiB")
        assert other.returncode == 0, other.stderr
        past = d.cgpuctl("resize", iid, "--mem", "15GiB")
        assert past.returncode != 0
        assert f"cannot resize instance {iid} to 15 GiB on GPU 0" in past.stderr, past.stderr
        assert "most free is 14 GiB on GPU 0" in past.stderr, past.stderr
        assert tenant.ask("info")["total"] == 14 * GIB
        assert d.cgpuctl("release", other.stdout.strip()).returncode == 0

        small = d.cgpuctl("resize", iid, "--mem", "2GiB")
        assert small.returncode == 0, small.stderr
        fits = d.cgpuctl("create", "--mem", "14GiB")
        assert fits.returncode == 0, fits.stderr
        inspect = d.cgpuctl("inspect")
        assert "16/16" in inspect.stdout.replace(" ", ""), inspect.stdout
    finally:
        tenant.stop()


def test_bad_resizes_change_nothing(one_gpu: Daemon, program: Path) -> None:
    d = one_gpu
    tenant = Tenant(d, program, "1GiB")
    try:
        iid = instance_of(d, tenant)["id"]
        cases = {
            ("resize", iid): "nothing to resize: give --mem, --core or both",
            ("resize", iid, "--mem", "0"): "ask for a memory size per GPU",
            ("resize", iid, "--mem", "17GiB"): "asked for 17 GiB on GPU 0, which has 16 GiB",
            ("resize", iid, "--core", "30"): "does not enforce compute shares",
            ("resize", "nosuchinstance", "--mem", "2GiB"): "nosuchinstance",
        }
        for argv, message in cases.items():
            done = d.cgpuctl(*argv)
            assert done.returncode != 0 and message in done.stderr, (argv, done.stderr)
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert tenant.ask("info")["total"] == 1 * GIB
        assert instance_of(d, tenant)["grants"][0]["memory_bytes"] == 1 * GIB
    finally:
        tenant.stop()


@pytest.mark.timing
def test_a_resized_share_holds_within_a_second(tmp_path: Path) -> None:
    """Two saturating tenants at fixed 30/70; then 70 -> 40 and 30 -> 60
    while they run. Shares from the simulated GPU's own per-process device
    time (cgpu-sim-stat), not from the scheduler."""
    rig = ShareRig(tmp_path, dict(os.environ))
    runs: list[subprocess.Popen[bytes]] = []
    sampler: Sampler | None = None
    try:
        d = rig.daemon
        assert d.cgpuctl("policy", "set", "fixed").returncode == 0
        sampler = Sampler(rig.env, 20)
        burn = TenantSpec(0).burn_args()
        runs = [start_burn_tenant(d, "512MiB", core, *burn) for core in (30, 70)]
        deadline = time.monotonic() + 60
        pids = [ShareRig._burn_pid(r, deadline) for r in runs]
        ShareRig._wait_running(sampler, pids, deadline)
        listed = json.loads(d.cgpuctl("list", "--output", "json").stdout)
        ids = [next(i["id"] for i in listed if pid in i["pids"]) for pid in pids]

        time.sleep(1.5)
        before_ns = time.monotonic_ns()
        time.sleep(1.0)
        with LocalClient(d.socket) as client:
            resized_ns = time.monotonic_ns()
            client.resize(ids[1], None, 40)
            client.resize(ids[0], None, 60)
        time.sleep(2.2)
        s = sampler.samples
        second = 1_000_000_000
        was = [busy_percent(s, p, before_ns, before_ns + second) for p in pids]
        first = [busy_percent(s, p, resized_ns, resized_ns + second) for p in pids]
        then = [busy_percent(s, p, resized_ns + second, resized_ns + 2 * second) for p in pids]
        print(f"\nshares before {was}, first second after {first}, the second after {then}")
        assert abs(was[0] - 30) <= 8 and abs(was[1] - 70) <= 8, was
        assert abs(then[0] - 60) <= 8 and abs(then[1] - 40) <= 8, then
        cores = {
            i["id"]: i["grants"][0]["core_percent"] for i in json.loads(d.cgpuctl("list", "--output", "json").stdout)
        }
        assert [cores[i] for i in ids] == [60, 40]
    finally:
        for r in runs:
            r.terminate()
        for r in runs:
            r.wait(timeout=30)
        if sampler is not None:
            sampler.stop()
        rig.close()
