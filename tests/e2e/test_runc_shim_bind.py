"""Bind and release by the runtime shim, as containerd and docker start a
container (`create --pid-file`, `start`, `delete`): the instance is bound to
the init pid when `create` returns, released when `delete` returns, and runc
runs no cgpu hook. Real runc, a real cgpud; the hook path (no --pid-file,
`run`, an engine without the shim) still binds and releases."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud.node.region import SPARE_REGION
from cgpud.native import native_path
from tests.harness.daemon import BIN, Daemon, running_daemon
from tests.harness.oci import Host, create, runc, runtime_env, shim_container
from tests.harness.wait import until

GPU = ("ALIYUN_COM_GPU_MEM_CONTAINER=2",)
SWEEP_WAIT_S = 10.0  # the e2e cgpud sweeps every 0.2 s


def instances(cgpud: Daemon, all_: bool = False) -> list[dict]:
    out = cgpud.cgpuctl("list", *(["--all"] if all_ else []), "--output", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def cgpu_hooks(config: dict) -> list[dict]:
    return [
        h for stage in (config.get("hooks") or {}).values() for h in stage if (h.get("args") or [""])[0] == "cgpu-hook"
    ]


def listed_in_root(host: Host) -> list[str]:
    out = runc(host, "list", "--quiet")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_shim_binds_at_create_and_releases_at_delete_without_hooks(tmp_path, host: Host, cgpud: Daemon) -> None:
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    cid = host.new_id()
    pid_file = tmp_path / "init.pid"
    code, log = create(host, b, cid, cgpud.relay, pid_file=pid_file)
    assert code == 0, log
    try:
        [inst] = instances(cgpud)
        # Bound when create returned, before start: no hook ran for it.
        assert inst["state"] == "bound" and inst["pids"] == [int(pid_file.read_text())]
        assert inst["owner"]["id"] == f"{cid}@{b.path}"
        assert cgpu_hooks(b.read()) == [] and "cgpu.io/instance" in b.read()["annotations"]
        assert runc(host, "start", cid, shim=True, relay=cgpud.relay).returncode == 0
    finally:
        runc(host, "kill", cid, "KILL", shim=True, relay=cgpud.relay)
        deleted = runc(host, "delete", "--force", cid, shim=True, relay=cgpud.relay)
    assert deleted.returncode == 0, deleted.stderr
    # Released by the shim's delete itself, not by a later sweep.
    assert instances(cgpud) == []
    assert [i["state"] for i in instances(cgpud, all_=True)] == ["released"]


def test_a_failed_bind_leaves_no_container_and_no_instance(tmp_path, host: Host, cgpud: Daemon) -> None:
    """The real runtime creates the container but its pid file names pid 1
    (a runtime or a file that lies): the shim refuses to bind, deletes the
    container and gives the instance back, with one message in runc's log."""
    pid_file = tmp_path / "init.pid"
    liar = tmp_path / "liar-runc"
    liar.write_text(f'#!/bin/sh\nrunc "$@" || exit $?\ncase " $* " in *" create "*) echo 1 > {pid_file};; esac\n')
    liar.chmod(0o755)
    env = runtime_env(cgpud.relay)
    env["CGPU_REAL_RUNTIME"] = str(liar)
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=pid_file, env=env)
    assert code == 1 and f"cannot read the init pid of container {cid}" in log, log
    assert cid not in listed_in_root(host)
    assert instances(cgpud) == []
    assert [i["state"] for i in instances(cgpud, all_=True)] == ["released"]


# "swapping-runc": the shim gives it the finished spec. "runc": it streams
# the spec, so the swap runs while cgpud checks the bundle.
@pytest.mark.parametrize("wrapper", ["swapping-runc", "runc"])
def test_a_link_swapped_in_before_runc_mounts_fails_the_create_and_leaves_nothing(
    tmp_path, host: Host, cgpud: Daemon, wrapper: str
) -> None:
    """A tenant's image racing the start, played by a runtime wrapper that
    turns the rootfs's /run into a link as `create` begins: runc follows it
    inside the root. It is refused before any process of the container
    runs, by cgpud's check at prepare if the link is there by then, else by
    the shim's bind: `create` fails with cgpud's reason, and no container
    and no instance are left."""
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    (tmp_path / "wrap").mkdir()
    swapper = tmp_path / "wrap" / wrapper
    swapper.write_text(f"""#!/bin/sh
case " $* " in *" create "*) rm -rf {b.rootfs}/run && mkdir -p {b.rootfs}/srv && ln -s /srv {b.rootfs}/run;; esac
exec {shutil.which("runc")} "$@"
""")
    swapper.chmod(0o755)
    env = runtime_env(cgpud.relay)
    env["CGPU_REAL_RUNTIME"] = str(swapper)
    cid = host.new_id()
    code, out = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid", env=env)
    try:
        assert code == 1, out
        refusals = ("cgpu's mount at /run/cgpu is not in place", "the image makes /run a symbolic link (to /srv)")
        assert any(r in out for r in (refusals if wrapper == "runc" else refusals[:1])), out
        assert cid not in listed_in_root(host)
        assert instances(cgpud) == []
    finally:
        runc(host, "delete", "--force", cid)


def test_runc_waits_on_a_fifo_at_config_json_and_gets_cgpuds_edit(tmp_path, host: Host, cgpud: Daemon) -> None:
    """The shim starts runc before cgpud has prepared the bundle, with a
    FIFO at config.json (cgpu_runtime.c, create_streamed). Afterwards the
    bundle holds cgpud's edit as a plain file, with the engine's mode, and
    nothing of the hand-over."""
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    (b.path / "config.json").chmod(0o640)
    before = sorted(os.listdir(b.path))
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid")
    try:
        assert code == 0, log
        st = os.lstat(b.path / "config.json")
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
        assert "cgpu.io/instance" in b.read()["annotations"]
        assert sorted(os.listdir(b.path)) == sorted([*before, "stdio.log"])
        [inst] = instances(cgpud)
        assert inst["state"] == "bound"
        [prepared] = [
            json.loads(line) for line in cgpud.log.read_text().splitlines() if '"prepared"' in line and cid in line
        ]
        assert prepared["spec_fd"] is True, prepared  # read through the shim's descriptor: the FIFO was in place
    finally:
        runc(host, "delete", "--force", cid)


def test_a_refused_streamed_create_puts_the_engines_spec_back(tmp_path, host: Host, cgpud: Daemon) -> None:
    """runc was already waiting on the FIFO when cgpud refused: it is killed
    before it read a spec, and config.json is the engine's again, byte for
    byte."""
    b = host.bundle(tmp_path / "b", ["sleep", "60"], ("ALIYUN_COM_GPU_MEM_CONTAINER=17",))
    (b.path / "config.json").chmod(0o640)
    before, listing = (b.path / "config.json").read_bytes(), sorted(os.listdir(b.path))
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid")
    assert code == 1 and "asked for 17 GiB per GPU but the largest GPU on this node has 16 GiB" in log, log
    assert log.count("cgpu-runtime:") == 1, log
    st = os.lstat(b.path / "config.json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert (b.path / "config.json").read_bytes() == before
    assert sorted(os.listdir(b.path)) == sorted([*listing, "stdio.log"])
    assert cid not in listed_in_root(host)
    assert instances(cgpud, all_=True) == []


def test_a_failed_create_keeps_runcs_exit_code_and_frees_the_instance(tmp_path, host: Host, cgpud: Daemon) -> None:
    b = host.bundle(tmp_path / "b", ["/no/such/program"], GPU)
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid")
    plain = runc(host, "create", "--bundle", str(b.path), host.new_id(), stdin=subprocess.DEVNULL)
    assert code == plain.returncode != 0, log
    assert "no such file" in log.lower(), log
    assert cid not in listed_in_root(host)
    assert instances(cgpud) == []


def test_without_a_pid_file_the_hook_binds_and_the_exit_releases(tmp_path, host: Host, cgpud: Daemon) -> None:
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    cid = host.new_id()
    with shim_container(host, b, cid, cgpud.relay, start=False):
        assert {h["args"][-1] for h in cgpu_hooks(b.read())} == {"createRuntime"}
        [inst] = instances(cgpud)
        state = json.loads(runc(host, "state", cid).stdout)
        assert inst["state"] == "bound" and inst["pids"] == [state["pid"]]
    wait_released(cgpud)


def test_a_delete_by_plain_runc_is_swept(tmp_path, host: Host, cgpud: Daemon) -> None:
    """An engine that bypasses the shim at delete: no poststop hook and no
    shim release, so cgpud's sweep frees the instance once the init is gone."""
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid")
    assert code == 0, log
    assert runc(host, "start", cid).returncode == 0
    deleted = runc(host, "delete", "--force", cid)  # plain runc
    assert deleted.returncode == 0, deleted.stderr
    wait_no_instances(cgpud, SWEEP_WAIT_S, 0.05, "the sweep to free the instance")
    # The shim's marker outlives that; a later delete of the id through the
    # shim (the container is gone) only repeats a release, and succeeds as runc's does.
    again = runc(host, "delete", cid, shim=True, relay=cgpud.relay)
    assert again.returncode == runc(host, "delete", cid).returncode


def test_the_container_gets_the_region_cgpud_made_ahead_and_none_outlives_cgpud(tmp_path, host: Host, gpu_env) -> None:
    (tmp_path / "d").mkdir()
    with running_daemon(tmp_path / "d", gpu_env) as d:
        spare = d.state / "instances" / SPARE_REGION
        assert os.path.ismount(spare)  # made once cgpud reconciled, before any start
        spare_fs = os.stat(spare).st_dev
        b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
        cid = host.new_id()
        code, log = create(host, b, cid, d.relay, pid_file=tmp_path / "init.pid")
        assert code == 0, log
        try:
            [inst] = instances(d)
            region = d.state / "instances" / inst["id"]
            assert os.path.ismount(region) and os.stat(region).st_dev == spare_fs
            # The container sees the limits written into it at the prepare.
            seen = runc(host, "exec", cid, "/bin/busybox", "sha256sum", "/run/cgpu/limits")
            assert seen.returncode == 0, seen.stderr
            assert seen.stdout.split()[0] == hashlib.sha256((region / "limits").read_bytes()).hexdigest()
            assert os.path.ismount(spare) and os.stat(spare).st_dev != spare_fs  # made again after the answer
        finally:
            runc(host, "delete", "--force", cid, shim=True, relay=d.relay)
    assert not spare.exists()  # cgpud stopped: its spare went with it


def test_a_non_gpu_container_never_asks_cgpud(tmp_path, host: Host) -> None:
    """No cgpud at all (its socket missing, no wait): a container that asked
    for nothing is created, started and deleted through the shim all the same."""
    sock = tmp_path / "no-cgpud.sock"
    env = runtime_env(sock)
    env["CGPU_RELAY_WAIT_MS"] = "0"
    b = host.bundle(tmp_path / "b", ["sleep", "60"], gpu_device=False)
    cid = host.new_id()
    code, log = create(host, b, cid, sock, pid_file=tmp_path / "init.pid", env=env)
    assert code == 0, log
    shim = [str(native_path("bin/cgpu-runtime")), "--root", str(host.runc_root)]
    for args in (["start", cid], ["delete", "--force", cid]):
        done = subprocess.run(
            [*shim, *args], env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)
    assert cid not in listed_in_root(host)


def watching_runtime(tmp_path, cgpud: Daemon) -> tuple[dict[str, str], Path]:
    """The real runc, behind a script that notes what cgpud lists just
    before each `delete` reaches runc."""
    seen = tmp_path / "listed-at-delete.json"
    script = tmp_path / "watching-runc"
    script.write_text(
        "#!/bin/sh\n"
        f"case \" $* \" in *\" delete \"*) '{BIN / 'cgpuctl'}' --socket '{cgpud.socket}' list --all --output json"
        f" > '{seen}';; esac\n"
        'exec runc "$@"\n'
    )
    script.chmod(0o755)
    env = runtime_env(cgpud.relay)
    env["CGPU_REAL_RUNTIME"] = str(script)
    return env, seen


def shim(host: Host, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(native_path("bin/cgpu-runtime")), "--root", str(host.runc_root), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def unswept(tmp_path, gpu_env) -> Iterator[Daemon]:
    """A cgpud whose sweep would come only after a minute: what releases
    within the tests' second is the exit watch."""
    (tmp_path / "unswept").mkdir()
    with running_daemon(tmp_path / "unswept", gpu_env, "--sweep-interval", "60") as d:
        yield d


def test_a_stopped_containers_instance_is_released_when_its_init_exits(tmp_path, host: Host, unswept: Daemon) -> None:
    """cgpud watches the init it bound (a pidfd): the instance goes when the
    container stops, before any delete, which is then runc's alone."""
    cgpud = unswept
    env, seen = watching_runtime(tmp_path, cgpud)
    b = host.bundle(tmp_path / "b", ["true"], GPU)
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid", env=env)
    assert code == 0, log
    assert shim(host, env, "start", cid).returncode == 0
    wait_released(cgpud)
    assert cid in listed_in_root(host)  # stopped, not deleted
    deleted = shim(host, env, "delete", cid)
    assert deleted.returncode == 0 and deleted.stderr == "", deleted.stderr
    assert [i["state"] for i in json.loads(seen.read_text())] == ["released"]
    assert cid not in listed_in_root(host)


def test_a_running_container_keeps_its_instance_until_the_runtime_killed_it(
    tmp_path, host: Host, unswept: Daemon
) -> None:
    """runc refuses a plain delete of a running container: its instance
    stays bound. delete --force kills the init: then it goes."""
    cgpud = unswept
    env, seen = watching_runtime(tmp_path, cgpud)
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid", env=env)
    assert code == 0, log
    assert shim(host, env, "start", cid).returncode == 0
    refused = shim(host, env, "delete", cid)
    assert refused.returncode != 0 and "running" in refused.stderr, refused.stderr
    assert [i["state"] for i in instances(cgpud)] == ["bound"]
    forced = shim(host, env, "delete", "--force", cid)
    assert forced.returncode == 0, forced.stderr
    assert [i["state"] for i in json.loads(seen.read_text())] == ["bound"]
    assert cid not in listed_in_root(host)
    wait_released(cgpud)


def wait_no_instances(cgpud: Daemon, within: float, interval: float, what: str) -> None:
    until(
        lambda: instances(cgpud) == [],
        timeout=within,
        interval=interval,
        what=what,
        explain=lambda: f"still active: {instances(cgpud)}",
    )


def wait_released(cgpud: Daemon, within: float = 1.0) -> None:
    """Long before the sweep would: the exit watch did it."""
    wait_no_instances(cgpud, within, 0.01, "the instance to be released")
    assert [i["state"] for i in instances(cgpud, all_=True)] == ["released"]


def test_a_container_outliving_a_cgpud_restart_is_released_at_its_exit_by_the_new_cgpud(
    tmp_path, host: Host, unswept: Daemon
) -> None:
    """Reconcile watches the inits it finds running: the exit that comes
    after a restart (here a kill -9 of cgpud) is seen as fast as before."""
    cgpud = unswept
    b = host.bundle(tmp_path / "b", ["sleep", "60"], GPU)
    cid = host.new_id()
    code, log = create(host, b, cid, cgpud.relay, pid_file=tmp_path / "init.pid")
    assert code == 0, log
    assert runc(host, "start", cid).returncode == 0
    cgpud.kill()
    cgpud.start()
    assert [i["state"] for i in instances(cgpud)] == ["bound"]  # adopted, not released
    assert runc(host, "kill", cid, "KILL").returncode == 0
    wait_released(cgpud)
    assert runc(host, "delete", cid).returncode == 0
