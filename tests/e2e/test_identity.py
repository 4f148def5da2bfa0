"""Which container holds which instance, with real runc: one container id
under two runtime roots (as containerd namespaces run it), poststops of
containers that hold nothing, and volumes that would redirect cgpu's mounts."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from cgpud.cli.client import LocalClient
from cgpud.node.model import GIB, Owner, OwnerKind, Request
from tests.harness.daemon import Daemon
from tests.harness.oci import Bundle, Host, create, host_mounts, plain_create, run, runc, shim_container
from tests.harness.containerd import Containerd, ctr_run_on_sim, loaded_binary_name
from tests.harness.workload import instances


def in_namespace(host: Host, tmp_path: Path, ns: str) -> Host:
    """The same host seen from another containerd namespace: its own runc
    root and its own bundle directory per container."""
    return dataclasses.replace(host, runc_root=tmp_path / ns / "runc")


def bundle_with_volume(host: Host, where: Path, destination: str, source: Path) -> Bundle:
    """A 2 GiB container running `true` with `source` bind-mounted read-write
    at `destination`, as a pod's volume is."""
    b = host.bundle(where, ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
    b.spec["mounts"].append(
        {"destination": destination, "type": "bind", "source": str(source), "options": ["rbind", "rw"]}
    )
    return b.write()


def refused(host: Host, cgpud: Daemon, b: Bundle) -> str:
    """Start `b` through the shim, which must refuse it; its stderr."""
    out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
    assert out.returncode != 0
    return out.stderr


def test_one_id_under_two_runtime_roots_gets_two_instances(tmp_path, host: Host, cgpud: Daemon) -> None:
    a, b = in_namespace(host, tmp_path, "ns-a"), in_namespace(host, tmp_path, "ns-b")
    ba = a.bundle(tmp_path / "ns-a" / "job", ["sleep", "60"], ("ALIYUN_COM_GPU_MEM_CONTAINER=8",))
    bb = b.bundle(tmp_path / "ns-b" / "job", ["sleep", "60"], ("ALIYUN_COM_GPU_MEM_CONTAINER=8",))
    try:
        for h, bundle in ((a, ba), (b, bb)):
            code, log = create(h, bundle, "job", cgpud.relay)
            assert code == 0, log
            assert runc(h, "start", "job", shim=True, relay=cgpud.relay).returncode == 0
        held = instances(cgpud)
        assert sorted(i["owner"]["id"] for i in held) == [f"job@{ba.path}", f"job@{bb.path}"]
        assert [i["state"] for i in held] == ["bound", "bound"]
        mine = next(i for i in held if i["owner"]["id"] == f"job@{ba.path}")
        pid_a = json.loads(runc(a, "state", "job").stdout)["pid"]
        assert mine["pids"] == [pid_a]

        runc(b, "kill", "job", "KILL", shim=True, relay=cgpud.relay)
        deleted = runc(b, "delete", "--force", "job", shim=True, relay=cgpud.relay)
        assert deleted.returncode == 0, deleted.stderr
        [left] = instances(cgpud)
        assert left["id"] == mine["id"] and left["state"] == "bound" and left["pids"] == [pid_a]
        # Its 8 GiB are still held: a third container cannot get them.
        third = host.bundle(tmp_path / "third", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=9",))
        out = run(host, third, "job", shim=True, relay=cgpud.relay)
        assert out.returncode != 0 and "cgpu-runtime:" in out.stderr, out.stderr
        assert [i["id"] for i in instances(cgpud)] == [mine["id"]]
    finally:
        for h in (a, b):
            runc(h, "kill", "job", "KILL", shim=True, relay=cgpud.relay)
            runc(h, "delete", "--force", "job", shim=True, relay=cgpud.relay)
    assert instances(cgpud) == []


@pytest.mark.parametrize("owner", ["claimed", "own"])
def test_a_poststop_of_a_container_that_holds_nothing_changes_nothing(
    tmp_path, host: Host, cgpud: Daemon, owner: str
) -> None:
    """A second container whose spec carries a poststop entry naming the
    first one's instance (as an older version wrote them, copied, or written
    by someone careless): the instance is not its own."""
    holder = host.bundle(
        tmp_path / "holder", ["sleep", "60"], () if owner == "claimed" else ("ALIYUN_COM_GPU_MEM_CONTAINER=2",)
    )
    if owner == "claimed":
        with LocalClient(cgpud.socket) as client:
            reserved = client.create(Request(Owner(OwnerKind.DEVICE, "train"), 2 * GIB))
        holder.spec["mounts"].append(
            {
                "destination": "/run/cgpu",
                "type": "bind",
                "options": ["rbind", "ro"],
                "source": str(cgpud.state / "instances" / reserved.id),
            }
        )
        holder.write()
    hid = host.new_id()
    with shim_container(host, holder, hid, cgpud.relay):
        [inst] = instances(cgpud)
        assert inst["state"] == "bound"
        other = host.bundle(tmp_path / "other", ["true"], gpu_device=False)
        [bind_hook] = holder.read()["hooks"]["createRuntime"]
        poststop = dict(bind_hook, args=[*bind_hook["args"][:-1], "poststop"])
        other.spec["hooks"] = {"poststop": [poststop]}
        other.write()
        out = run(host, other, host.new_id(), shim=False)  # plain runc: its poststop runs cgpu-hook
        # Neither runc nor the hook reports a failure for the other container.
        assert out.returncode == 0 and "cgpu-hook" not in out.stderr, out.stderr
        [still] = instances(cgpud)
        assert (still["id"], still["state"], still["pids"]) == (inst["id"], "bound", inst["pids"])
    # The holder's own exit did hand it back (claimed) or release it (own).
    assert [i["state"] for i in instances(cgpud)] == (["reserved"] if owner == "claimed" else [])


@pytest.mark.parametrize(
    ("volume", "link", "target"),
    [
        ("/run", "cgpu", "/run/cgpu"),
        ("/etc", "ld.so.preload", "/etc/ld.so.preload"),
        ("/usr/local", "cgpu", "/usr/local/cgpu/libcgpu.so"),
    ],
)
@pytest.mark.parametrize("escape", ["/proc/self/cwd", "/../../../../{out}/x"])
def test_a_volume_whose_source_holds_a_link_on_cgpus_way_is_refused(
    tmp_path, host: Host, cgpud: Daemon, volume: str, link: str, target: str, escape: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    source = tmp_path / "volume"
    source.mkdir()
    (source / link).symlink_to(escape.format(out=outside))
    b = bundle_with_volume(host, tmp_path / "b", volume, source)

    def mine() -> list[str]:
        return [m for m in host_mounts() if str(tmp_path) in m]  # others' tests mount too

    before, mounts_before = b.read(), mine()
    err = refused(host, cgpud, b)
    assert (
        f"the volume at {volume} (from {source}) makes {volume}/{link} a symbolic link "
        f"({source / link} -> {escape.format(out=outside)})"
    ) in err, err
    assert target in err and err.count("cgpu-runtime:") == 1
    assert b.read() == before
    assert instances(cgpud) == []  # admitted, then released before the bundle was touched
    assert list(outside.iterdir()) == [] and sorted(os.listdir(source)) == [link]
    assert mine() == mounts_before


def test_a_shared_volume_over_run_is_refused_even_without_links(tmp_path, host: Host, cgpud: Daemon) -> None:
    """An emptyDir a sidecar also mounts: from outside this container's
    mount namespace, rmdir of the empty `cgpu` directory in it succeeds and
    detaches cgpu's mounts from this container; so it never starts."""
    source = tmp_path / "empty-dir"
    source.mkdir()
    b = bundle_with_volume(host, tmp_path / "b", "/run", source)
    before = b.read()
    err = refused(host, cgpud, b)
    assert (
        f"cgpu-runtime: the volume at /run (from {source}) covers /run/cgpu, where cgpu mounts its files: "
        f"anyone else who can write {source} could remove cgpu's mount points there"
    ) in err, err
    assert b.read() == before and instances(cgpud) == [] and list(source.iterdir()) == []


def test_a_tmpfs_at_run_and_volumes_beside_cgpus_paths_still_start_with_their_limit(
    tmp_path, host: Host, cgpud: Daemon
) -> None:
    source = tmp_path / "conf"
    source.mkdir()
    (source / "app.conf").write_text("x\n")
    b = host.bundle(
        tmp_path / "b",
        ["sh", "-c", "cat /etc/ld.so.preload; ls /run/cgpu; cat /etc/app/app.conf"],
        ("ALIYUN_COM_GPU_MEM_CONTAINER=2",),
    )
    b.spec["mounts"] += [
        {"destination": "/etc/app", "type": "bind", "source": str(source), "options": ["rbind", "ro"]},
        {"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]},
    ]
    b.write()
    out = run(host, b, host.new_id(), shim=True, relay=cgpud.relay)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["/usr/local/cgpu/libcgpu.so", "grants", "limits", "usage", "x"]


def test_a_volume_at_var_run_in_an_image_where_it_links_to_run_is_refused(tmp_path, host: Host, cgpud: Daemon) -> None:
    """Debian images have /var/run -> /run, and runc follows it: a shared
    volume written as /var/run is mounted over /run."""
    source = tmp_path / "empty-dir"
    source.mkdir()
    b = bundle_with_volume(host, tmp_path / "b", "/var/run", source)
    (b.rootfs / "var").mkdir(exist_ok=True)
    (b.rootfs / "var" / "run").symlink_to("/run")
    before = b.read()
    err = refused(host, cgpud, b)
    assert f"the volume at /run (written as /var/run) (from {source}) covers /run/cgpu" in err, err
    assert b.read() == before and instances(cgpud) == [] and list(source.iterdir()) == []


def _ask(relay: Path, request: str) -> str:
    """A relay request cgpu-runtime would send, sent by hand so that the
    test can change the rootfs between cgpud's check and runc's mounts."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(relay))
        s.sendall(request.encode())
        s.shutdown(socket.SHUT_WR)
        return s.makefile().readline().strip()


def _prepare(relay: Path, container_id: str, bundle: Path) -> str:
    return _ask(relay, f"prepare {container_id}\n{bundle}")


def test_a_link_swapped_in_after_the_check_keeps_the_container_from_starting(
    tmp_path, host: Host, cgpud: Daemon
) -> None:
    b = host.bundle(tmp_path / "b", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
    cid = host.new_id()
    assert _prepare(cgpud.relay, cid, b.path).startswith("ok instance ")
    [prepared] = instances(cgpud)
    # Between the check and the mount: /run becomes a link (inside the root).
    shutil.rmtree(b.rootfs / "run")
    (b.rootfs / "srv").mkdir()
    (b.rootfs / "run").symlink_to("/srv")
    code, log = plain_create(host, b, cid)
    try:
        assert code != 0
        assert "cgpu-hook: cgpu's mount at /run/cgpu is not in place" in log, log
        assert runc(host, "state", cid).returncode != 0  # no container left
        assert instances(cgpud) == []
        assert [i["state"] for i in instances(cgpud, all_=True) if i["id"] == prepared["id"]] == ["released"]
    finally:
        runc(host, "delete", "--force", cid)


def test_a_link_swapped_in_after_the_check_fails_the_shims_own_bind(tmp_path, host: Host, cgpud: Daemon) -> None:
    """The shim's path: cgpud remembers the rootfs its prepare checked and
    checks the init's mounts there at the bind, without the spec again."""
    b = host.bundle(tmp_path / "b", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
    cid = host.new_id()
    answer = _ask(cgpud.relay, f"prepare {cid} shim-binds\n{b.path}")
    assert answer.startswith("ok instance "), answer
    instance = answer.split()[-1]
    shutil.rmtree(b.rootfs / "run")
    (b.rootfs / "srv").mkdir()
    (b.rootfs / "run").symlink_to("/srv")
    pid_file = tmp_path / "pid"
    with open(tmp_path / "create.log", "w") as f:
        code = subprocess.run(
            [
                "runc",
                "--root",
                str(host.runc_root),
                "create",
                "--bundle",
                str(b.path),
                "--pid-file",
                str(pid_file),
                cid,
            ],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=f,
            timeout=60,
        ).returncode
    try:
        assert code == 0  # runc follows the link inside the root: only cgpud's bind can tell
        state = json.dumps(
            {
                "ociVersion": "1.0.2",
                "id": cid,
                "bundle": str(b.path),
                "status": "created",
                "pid": int(pid_file.read_text()),
            }
        )
        answer = _ask(cgpud.relay, f"bind {instance}\n{state}")
        assert answer.startswith("error cgpu's mount at /run/cgpu is not in place"), answer
        assert instances(cgpud) == []  # its own instance went with the refusal
    finally:
        runc(host, "delete", "--force", cid)


def test_one_id_in_two_containerd_namespaces_gets_two_instances(
    tmp_path, host: Host, cgpud: Daemon, containerd: Containerd
) -> None:
    binary = loaded_binary_name(containerd.config)

    def ctr(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
        return containerd.ctr("--namespace", ns, *args)

    def start(ns: str, gib: int) -> subprocess.CompletedProcess[str]:
        env = (f"ALIYUN_COM_GPU_MEM_CONTAINER={gib}",)
        rootfs = tmp_path / f"rootfs-{ns}"
        return ctr_run_on_sim(
            containerd, host, rootfs, binary, env, "job", "sleep", "60", namespace=ns, run_opts=("-d",)
        )

    def remove(ns: str) -> None:
        ctr(ns, "task", "kill", "--signal", "SIGKILL", "job")
        for _ in range(300):  # the task goes once its process has been reaped
            if ctr(ns, "task", "delete", "job").returncode == 0 or "job" not in ctr(ns, "task", "ls").stdout:
                break
        ctr(ns, "container", "delete", "job")

    try:
        for ns in ("ns-a", "ns-b"):
            out = start(ns, 8)
            assert out.returncode == 0, out.stderr + containerd.log.read_text()[-2000:]
        owners = sorted(i["owner"]["id"] for i in instances(cgpud))
        assert len(owners) == 2 and [o.split("@")[0] for o in owners] == ["job", "job"]
        assert [o.rstrip("/").split("/")[-2:] for o in owners] == [["ns-a", "job"], ["ns-b", "job"]]
        remove("ns-b")
        [left] = instances(cgpud)
        assert left["state"] == "bound" and left["owner"]["id"] == owners[0]
        third = host.bundle(tmp_path / "third", ["true"], ("ALIYUN_COM_GPU_MEM_CONTAINER=9",))
        assert run(host, third, "job", shim=True, relay=cgpud.relay).returncode != 0
    finally:
        remove("ns-a")
        remove("ns-b")
    assert instances(cgpud) == []
