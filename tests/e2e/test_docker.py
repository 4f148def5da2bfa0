"""GPU containers through a real, throwaway Docker (Debian's docker.io:
dockerd on a containerd of its own, as docker.service runs it) with
cgpu-runtime registered by `cgpuctl runtime configure --docker` and loaded
by a reload (SIGHUP). The same checks as the containerd and runc tests, the
way Docker calls the runtime: containerd-shim-runc-v2 runs `cgpu-runtime
--root <exec-root>/runtime-runc/moby --log <bundle>/log.json --log-format
json create --bundle <bundle> …`, the bundle being
`<containerd state>/io.containerd.runtime.v2.task/moby/<64-hex id>`.

One dockerd serves the module; every test has its own cgpud and simulated
GPU, on the one relay socket containerd was started with."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cgpud.cli.client import LocalClient
from cgpud.node.model import GIB, Owner, OwnerKind, Request
from cgpud.native import native_path
from tests.harness.daemon import BIN, Daemon, running_daemon
from tests.harness.docker import IMAGE, Dockerd, running_dockerd
from tests.harness.oci import plant_symlink, runtime_env, settled, steady_mounts
from tests.harness.workload import (
    BURN,
    assert_2gib_granted,
    assert_no_breakout,
    breakout_script,
    burn_json,
    env_lines,
    instances,
)
from tests.harness.preload_poc import build_poc
from tests.harness.wait import until

# An operator's settings that `runtime configure` must keep.
OPERATOR_JSON = {"log-level": "info", "live-restore": True, "runtimes": {"other": {"path": "runc"}}}
MODULE_RELAY = "relay/relay.sock"
# A stand-in for the NVIDIA container toolkit's prestart hook, which dockerd
# adds for `--gpus` when it finds the program on its PATH: it records the
# devices the container is given, as the real one would mount them.
TOOLKIT_HOOK = """#!/bin/sh
state=$(cat)
id=$(printf '%s' "$state" | sed -n 's/.*"id":"\\([^"]*\\)".*/\\1/p')
bundle=$(printf '%s' "$state" | sed -n 's/.*"bundle":"\\([^"]*\\)".*/\\1/p')
grep -o '"NVIDIA_VISIBLE_DEVICES=[^"]*"' "$bundle/config.json" > "{seen}/$id"
"""


@pytest.fixture(scope="module")
def dockerd(tmp_path_factory: pytest.TempPathFactory, rootfs_template: Path) -> Iterator[Dockerd]:
    base = tmp_path_factory.mktemp("docker")
    env = runtime_env(base / MODULE_RELAY)
    env["CGPU_RELAY_WAIT_MS"] = "300"  # how long the relays wait for a cgpud that is down
    toolkit = base / "toolkit"
    (toolkit / "seen").mkdir(parents=True)
    hook = toolkit / "nvidia-container-runtime-hook"
    hook.write_text(TOOLKIT_HOOK.format(seen=toolkit / "seen"))
    hook.chmod(0o755)
    with running_dockerd(base / "d", OPERATOR_JSON, env, dockerd_path=toolkit) as d:
        assert "cgpu" not in d.runtimes()
        configured = subprocess.run(
            [str(BIN / "cgpuctl"), "runtime", "configure", "--docker", "--config", str(d.config)],
            capture_output=True,
            text=True,
        )
        assert configured.returncode == 0, configured.stderr
        assert 'reload docker (systemctl reload docker) to load the runtime "cgpu"' in configured.stdout
        # Runtimes are among the settings dockerd reloads (systemctl reload docker).
        d.reload()
        until(
            lambda: "cgpu" in d.runtimes(),
            timeout=20,
            interval=0.1,
            what="dockerd to load the runtime cgpu",
            explain=lambda: f"dockerd's log ends:\n{d.tail()}",
        )
        d.import_rootfs(rootfs_template, IMAGE)
        yield d
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def cgpud(tmp_path: Path, gpu_env: dict[str, str], dockerd: Dockerd) -> Iterator[Daemon]:
    with running_daemon(tmp_path, gpu_env, "--relay-socket", str(dockerd.relay)) as d:
        yield d


def docker_run(
    d: Dockerd,
    gpu_env: dict[str, str],
    *cmd: str,
    env: tuple[str, ...] = (),
    runtime: str | None = "cgpu",
    opts: tuple[str, ...] = ("--rm",),
    image: str = IMAGE,
) -> subprocess.CompletedProcess[str]:
    """`docker run` with the simulated device handed in as the NVIDIA
    toolkit would hand in the real one (tests/harness/oci.py); runtime None:
    dockerd's default runtime."""
    sim = Path(gpu_env["CGPU_SIM_CONFIG"]).parent
    args = ["run", "--network", "none", *(["--runtime", runtime] if runtime else [])]
    args += [
        "-v",
        f"{sim}:{sim}",
        "-e",
        f"CGPU_SIM_CONFIG={gpu_env['CGPU_SIM_CONFIG']}",
        "-e",
        f"CGPU_SIM_STATE={gpu_env['CGPU_SIM_STATE']}",
    ]
    for e in env:
        args += ["-e", e]
    return d.docker(*args, *opts, image, *cmd)


def docker_sh(d: Dockerd, gpu_env: dict[str, str], script: str, **options: Any) -> subprocess.CompletedProcess[str]:
    """docker_run of `sh -c script`."""
    return docker_run(d, gpu_env, "sh", "-c", script, **options)


def state(d: Dockerd, name: str) -> dict:
    out = d.docker("inspect", name)
    assert out.returncode == 0, out.stderr
    [info] = json.loads(out.stdout)
    return info


def owner(d: Dockerd, container_id: str) -> str:
    """The instance owner cgpud records: Docker's full id and the bundle its
    containerd made for it."""
    return f"{container_id}@{d.task_dir / container_id}"


@contextmanager
def detached_gpu_container(dockerd: Dockerd, gpu_env: dict[str, str], gib: int) -> Iterator[tuple[str, str]]:
    """`docker run -d` of a container asking for gib GiB that sleeps; yields
    its name and Docker's id, and removes it (the removal checked) after."""
    name = f"cgpu-e2e-{uuid.uuid4().hex[:8]}"
    out = docker_run(
        dockerd, gpu_env, "sleep", "600", env=(f"ALIYUN_COM_GPU_MEM_CONTAINER={gib}",), opts=("-d", "--name", name)
    )
    assert out.returncode == 0, out.stderr + dockerd.tail()
    try:
        yield name, out.stdout.strip()
    finally:
        removed = dockerd.docker("rm", "-f", name)
    assert removed.returncode == 0, removed.stderr


def assert_exec_burn_stops_at(dockerd: Dockerd, name: str, gib: int) -> None:
    """cgpu-burn by `docker exec` in a running container: it joins the
    container's instance, so its allocations stop at the container's limit."""
    ex = dockerd.docker("exec", name, "sh", "-c", BURN)
    assert ex.returncode == 0, ex.stderr
    assert burn_json(ex.stdout)["alloc"]["until_fail_bytes"] == gib * GIB


def test_runtime_configure_registers_the_shim_dockerd_reloads(dockerd: Dockerd) -> None:
    runtimes = dockerd.runtimes()
    assert runtimes["cgpu"]["path"] == str(native_path("bin/cgpu-runtime"))
    assert runtimes["other"]["path"] == "runc"
    saved = json.loads(dockerd.config.read_text())
    assert saved["log-level"] == "info" and saved["live-restore"] is True
    assert saved["runtimes"]["other"] == {"path": "runc"}


def test_doctor_reports_the_runtime_dockerd_loaded(tmp_path, cgpud: Daemon, dockerd: Dockerd) -> None:
    settings = tmp_path / "doctor.toml"
    settings.write_text(f'state_dir = "{cgpud.state}"\n')
    runtime = native_path("bin/cgpu-runtime")
    # Named, and found as the --config-file of the running dockerd.
    for args in (("--docker-config", str(dockerd.config)), ()):
        out = cgpud.cgpuctl("doctor", "--config", str(settings), *args)
        assert f'ok    container runtime: docker: runtime "cgpu" runs {runtime} ({dockerd.config})' in out.stdout, (
            out.stdout
        )
    # Pointed at a daemon.json whose runtime has gone, it says so.
    stale = tmp_path / "daemon.json"
    stale.write_text(json.dumps({"runtimes": {"cgpu": {"path": str(tmp_path / "gone" / "cgpu-runtime")}}}))
    out = cgpud.cgpuctl("doctor", "--config", str(settings), "--docker-config", str(stale))
    assert (
        f'warn  container runtime: {stale}: runtime "cgpu" runs {tmp_path / "gone" / "cgpu-runtime"}, which is '
        "not an executable file" in out.stdout
    ), out.stdout


def test_2gib_container_through_docker(tmp_path, gpu_env, cgpud: Daemon, dockerd: Dockerd, nvml_total: Path) -> None:
    cidfile = tmp_path / "cid"
    out = docker_sh(
        dockerd,
        gpu_env,
        f"env; nvml-total; {BURN}",
        env=("ALIYUN_COM_GPU_MEM_CONTAINER=2",),
        opts=("--rm", "--cidfile", str(cidfile), "-v", f"{nvml_total}:/usr/bin/nvml-total:ro"),
    )
    assert out.returncode == 0, out.stderr + dockerd.tail()
    assert f"NVML_TOTAL={2 * GIB}" in out.stdout.splitlines()  # what nvidia-smi would show
    assert_2gib_granted(out.stdout)
    assert instances(cgpud) == []
    [gone] = instances(cgpud, all_=True)
    assert gone["state"] == "released"
    assert gone["owner"]["id"] == owner(dockerd, cidfile.read_text().strip())


def test_a_container_holds_its_instance_across_exec_restart_stop_and_start(
    gpu_env, cgpud: Daemon, dockerd: Dockerd
) -> None:
    with detached_gpu_container(dockerd, gpu_env, 3) as (name, cid):

        def bound_to_init() -> dict:
            [inst] = instances(cgpud)
            assert inst["state"] == "bound"
            assert inst["owner"]["id"] == owner(dockerd, cid)
            assert inst["pids"] == [state(dockerd, name)["State"]["Pid"]]
            return inst

        first = bound_to_init()
        # `docker exec` joins the container: the same library, region and limit.
        assert_exec_burn_stops_at(dockerd, name, 3)
        # Its env is Docker's record of the container, not the spec cgpud
        # edited: the request is there, cgpud's outputs only in the init's.
        ex = dockerd.docker("exec", name, "sh", "-c", "env; echo; tr '\\0' '\\n' < /proc/1/environ")
        mine, init = ex.stdout.split("\n\n", 1)
        assert env_lines(mine)["ALIYUN_COM_GPU_MEM_CONTAINER"] == "3" and "ALIYUN_COM_GPU_MEM_DEV" not in mine
        assert env_lines(init)["ALIYUN_COM_GPU_MEM_DEV"] == "16"
        assert instances(cgpud)[0]["id"] == first["id"]

        assert dockerd.docker("restart", "-t", "0", name).returncode == 0
        second = bound_to_init()
        assert second["id"] != first["id"]

        assert dockerd.docker("stop", "-t", "0", name).returncode == 0
        assert instances(cgpud) == []  # stopped, not removed: the instance is gone all the same
        assert dockerd.docker("start", name).returncode == 0
        bound_to_init()
        assert dockerd.docker("kill", name).returncode == 0
        until(  # docker kill returns once the signal is sent
            lambda: not instances(cgpud),
            timeout=10,
            interval=0.05,
            what="the killed container's instance to be released",
            explain=lambda: f"{instances(cgpud)}",
        )
    assert instances(cgpud) == []
    assert [i["state"] for i in instances(cgpud, all_=True)] == ["released"] * 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (("ALIYUN_COM_GPU_MEM_CONTAINER=17",), "asked for 17 GiB per GPU but the largest GPU on this node has 16 GiB"),
        (("ALIYUN_COM_GPU_MEM_CONTAINER=lots",), "ALIYUN_COM_GPU_MEM_CONTAINER='lots' is not a whole number of GiB"),
        (
            ("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=30"),
            "node mode cgpu does not enforce compute shares",
        ),
    ],
)
def test_refusal_reaches_the_docker_user_and_leaves_nothing(
    gpu_env, cgpud: Daemon, dockerd: Dockerd, env, message
) -> None:
    out = docker_run(dockerd, gpu_env, "true", env=env)
    assert out.returncode == 125  # docker run's own "the container could not be started"
    assert f"OCI runtime create failed: cgpu-runtime: {message}" in out.stderr, out.stderr
    assert instances(cgpud, all_=True) == []
    assert dockerd.docker("ps", "-aq").stdout.strip() == ""


def test_the_21st_instance_on_a_gpu_is_refused(gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    with LocalClient(cgpud.socket) as client:
        for i in range(20):
            client.create(Request(Owner(OwnerKind.PROCESS, f"holder-{i}"), 512 << 20), pid=os.getpid())
    out = docker_run(dockerd, gpu_env, "true", env=("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
    assert out.returncode != 0
    assert "max_instances_per_gpu" in out.stderr and "20 instances" in out.stderr, out.stderr
    assert len(instances(cgpud, all_=True)) == 20


def test_a_non_gpu_container_runs_exactly_as_under_runc(gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    script = "env | sort; wc -l < /proc/self/mountinfo; ls /etc /run /usr/local; echo hi"
    runs = [
        docker_run(dockerd, gpu_env, "sh", "-c", script, runtime=rt, opts=("--rm", "--hostname", "plain"))
        for rt in ("runc", "cgpu")
    ]
    for out in runs:
        assert out.returncode == 0, out.stderr
    assert runs[0].stdout == runs[1].stdout and runs[1].stdout.endswith("hi\n")
    assert instances(cgpud, all_=True) == []
    # With cgpud down, only containers that ask for a GPU fail.
    cgpud.stop()
    out = docker_run(dockerd, gpu_env, "echo", "still fine")
    assert out.returncode == 0 and out.stdout == "still fine\n", out.stderr
    out = docker_run(dockerd, gpu_env, "true", env=("ALIYUN_COM_GPU_MEM_CONTAINER=1",))
    assert out.returncode != 0
    assert "OCI runtime create failed: cgpu-runtime: cgpud" in out.stderr and str(dockerd.relay) in out.stderr, (
        out.stderr
    )


def test_compute_share_on_a_core_mem_node(tmp_path, gpu_env, dockerd: Dockerd) -> None:
    with running_daemon(tmp_path, gpu_env, "--relay-socket", str(dockerd.relay), "--mode", "core_mem") as d:
        out = docker_run(
            dockerd, gpu_env, "true", env=("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=33")
        )
        assert out.returncode != 0
        assert "asked for 33% compute: ask for 0 (no share) or a multiple of 5" in out.stderr, out.stderr
        assert instances(d, all_=True) == []
        name = f"cgpu-e2e-{uuid.uuid4().hex[:8]}"
        out = docker_sh(
            dockerd,
            gpu_env,
            "env; sleep 600",
            env=("ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=30"),
            opts=("-d", "--name", name),
        )
        assert out.returncode == 0, out.stderr
        try:
            [inst] = instances(d)
            assert [(g["memory_bytes"], g["core_percent"]) for g in inst["grants"]] == [(GIB, 30)]

            def env_logged() -> str:
                text = dockerd.docker("logs", name).stdout
                return text if "ALIYUN_COM_GPU_CORE_PERCENTAGE" in text else ""

            logs = until(
                env_logged,
                timeout=10,
                interval=0.05,
                what="the container's environment in its logs",
                explain=lambda: dockerd.docker("logs", name).stdout,
            )
            assert env_lines(logs)["ALIYUN_COM_GPU_CORE_PERCENTAGE"] == "30"
        finally:
            assert dockerd.docker("rm", "-f", name).returncode == 0
        assert instances(d) == []


# ---------------------------------------------------------------- hostile images


def _image_with_symlink(dockerd: Dockerd, template: Path, where: Path, link: str, target: str) -> str:
    rootfs = where / "rootfs"
    subprocess.run(["cp", "-al", str(template), str(rootfs)], check=True)
    plant_symlink(rootfs, link, target)
    tag = f"cgpu-e2e:hostile-{uuid.uuid4().hex[:8]}"
    dockerd.import_rootfs(rootfs, tag)
    return tag


@pytest.mark.parametrize(
    ("link", "escape", "refused"),
    [
        # Docker's init layer unlinks /etc and makes it a real directory
        # (for /etc/hosts and friends): the container starts, contained.
        ("/etc", "/../../../{out}", False),
        ("/etc/ld.so.preload", "/../../../{out}/preload", True),
        ("/etc/ld.so.preload", "/proc/sys/kernel/core_pattern", True),
        ("/usr/local", "/../../../{out}", True),
        ("/run", "/proc/self/cwd", True),
    ],
)
def test_symlinks_in_an_image_never_lead_outside_it(
    tmp_path, gpu_env, rootfs_template, cgpud: Daemon, dockerd: Dockerd, mounts, link: str, escape: str, refused: bool
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    tag = _image_with_symlink(dockerd, rootfs_template, tmp_path, link, escape.format(out=outside))
    mounts_before = steady_mounts(mounts)
    try:
        out = docker_sh(
            dockerd,
            gpu_env,
            f"cat /etc/ld.so.preload; {BURN}",
            env=("ALIYUN_COM_GPU_MEM_CONTAINER=2",),
            image=tag,
        )
    finally:
        dockerd.docker("rmi", tag)
    # Either it failed saying why or it started with its limit.
    if refused:
        assert out.returncode != 0
        assert f"cgpu-runtime: the image makes {link} a symbolic link" in out.stderr, out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0] == "/usr/local/cgpu/libcgpu.so"
        assert burn_json(out.stdout)["alloc"]["until_fail_bytes"] == 2 * GIB
    assert list(outside.iterdir()) == []
    assert Path("/proc/sys/kernel/core_pattern").read_text() == core_pattern
    # cgpud remakes its spare region and unmounts a released one on threads
    # of its own, a moment after the runtime returned: a leak still shows
    # after the wait (a fresh-clone run once read 2 spare regions at once).
    assert settled(mounts, mounts_before) == mounts_before
    assert instances(cgpud) == []


def test_an_image_ld_preload_from_cwd_never_runs_on_the_host(
    tmp_path, gpu_env, rootfs_template, cgpud: Daemon, dockerd: Dockerd
) -> None:
    """The NVIDIAScape pattern, in an image: LD_PRELOAD resolving through a
    hook's working directory to a library in the rootfs."""
    marker = Path("/tmp") / f"cgpu-poc-{uuid.uuid4().hex}"
    rootfs = tmp_path / "rootfs"
    subprocess.run(["cp", "-al", str(rootfs_template), str(rootfs)], check=True)
    (rootfs / "poc.so").write_bytes(build_poc(tmp_path, marker).read_bytes())
    tag = f"cgpu-e2e:poc-{uuid.uuid4().hex[:8]}"
    dockerd.import_rootfs(rootfs, tag)
    try:
        out = docker_sh(
            dockerd,
            gpu_env,
            "cgpu-burn --help >/dev/null; ls /tmp",
            env=("ALIYUN_COM_GPU_MEM_CONTAINER=1", "LD_PRELOAD=/proc/self/cwd/poc.so"),
            opts=("--rm", "--workdir", "/"),
            image=tag,
        )
        assert out.returncode == 0, out.stderr
        assert marker.name in out.stdout  # it ran inside the container...
        assert not marker.exists()  # ...and nowhere on the host
    finally:
        dockerd.docker("rmi", tag)
        marker.unlink(missing_ok=True)


def test_a_container_cannot_write_its_limits_or_reach_other_instances(gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    with detached_gpu_container(dockerd, gpu_env, 1):
        [other] = instances(cgpud)
        other_region = cgpud.state / "instances" / other["id"]
        other_limits = (other_region / "limits").read_bytes()
        script = breakout_script(other_region)
        for user in ("0", "1000"):
            out = docker_sh(
                dockerd,
                gpu_env,
                script,
                env=("ALIYUN_COM_GPU_MEM_CONTAINER=1",),
                opts=("--rm", "--user", f"{user}:{user}"),
            )
            assert out.returncode == 0, out.stderr
            assert_no_breakout(out.stdout, user)
        assert (other_region / "limits").read_bytes() == other_limits
    assert instances(cgpud) == []


def test_mount_table_unchanged_after_10_containers_5_at_a_time(
    gpu_env, cgpud: Daemon, dockerd: Dockerd, mounts
) -> None:
    before = steady_mounts(mounts)
    with ThreadPoolExecutor(5) as pool:
        runs = list(
            pool.map(
                lambda _: docker_run(dockerd, gpu_env, "sh", "-c", BURN, env=("ALIYUN_COM_GPU_MEM_CONTAINER=1",)),
                range(10),
            )
        )
    for out in runs:
        assert out.returncode == 0, out.stderr
        assert burn_json(out.stdout)["alloc"]["until_fail_bytes"] == GIB
    assert settled(mounts, before) == before
    assert instances(cgpud) == []
    assert len(instances(cgpud, all_=True)) == 10


@pytest.mark.parametrize(
    "opts", [("-t",), ("--read-only",), ("--init",), ("--tmpfs", "/run"), ("--ipc", "host")], ids=lambda o: " ".join(o)
)
def test_docker_run_options_keep_the_limit(gpu_env, cgpud: Daemon, dockerd: Dockerd, opts) -> None:
    out = docker_run(dockerd, gpu_env, "sh", "-c", BURN, env=("ALIYUN_COM_GPU_MEM_CONTAINER=1",), opts=("--rm", *opts))
    assert out.returncode == 0, out.stderr
    assert burn_json(out.stdout)["alloc"]["until_fail_bytes"] == GIB
    assert instances(cgpud) == []


def test_a_volume_over_run_is_refused(tmp_path, gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    source = tmp_path / "volume"
    source.mkdir()
    out = docker_run(
        dockerd, gpu_env, "true", env=("ALIYUN_COM_GPU_MEM_CONTAINER=1",), opts=("--rm", "-v", f"{source}:/run")
    )
    assert out.returncode != 0
    assert f"cgpu-runtime: the volume at /run (from {source}) covers /run/cgpu" in out.stderr, out.stderr
    assert list(source.iterdir()) == []
    assert instances(cgpud) == []  # admitted, then released when the check failed


def test_cgpu_as_the_default_runtime(gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    before = dockerd.config.read_text()
    try:
        configured = subprocess.run(
            [
                str(BIN / "cgpuctl"),
                "runtime",
                "configure",
                "--docker",
                "--set-as-default",
                "--config",
                str(dockerd.config),
            ],
            capture_output=True,
            text=True,
        )
        assert configured.returncode == 0, configured.stderr
        dockerd.reload()
        _wait_default_runtime(dockerd, "cgpu")
        out = docker_run(dockerd, gpu_env, "sh", "-c", BURN, env=("ALIYUN_COM_GPU_MEM_CONTAINER=2",), runtime=None)
        assert out.returncode == 0, out.stderr
        assert burn_json(out.stdout)["alloc"]["until_fail_bytes"] == 2 * GIB
        assert [i["state"] for i in instances(cgpud, all_=True)] == ["released"]
    finally:
        # A reload keeps the default runtime when daemon.json no longer
        # names one: it has to be named back.
        dockerd.config.write_text(json.dumps(json.loads(before) | {"default-runtime": "runc"}))
        dockerd.reload()
        _wait_default_runtime(dockerd, "runc")


def _wait_default_runtime(dockerd: Dockerd, runtime: str) -> None:
    """Until the reloaded dockerd has `runtime` as its default."""
    until(
        lambda: dockerd.docker("info", "--format", "{{.DefaultRuntime}}").stdout.strip() == runtime,
        timeout=20,
        interval=0.1,
        what=f"dockerd's default runtime to be {runtime}",
        explain=dockerd.tail,
    )


def toolkit_saw(
    dockerd: Dockerd, gpu_env: dict[str, str], env: tuple[str, ...] = (), image: str = IMAGE, gpus: bool = True
) -> tuple[list[str], str]:
    """(what the toolkit's hook read in the spec, what the container's
    process sees) for one `docker run`."""
    seen = dockerd.root.parent / "toolkit" / "seen"
    cidfile = seen.parent / f"cid-{uuid.uuid4().hex[:8]}"
    opts = ("--rm", "--cidfile", str(cidfile), *(("--gpus", "all") if gpus else ()))
    out = docker_run(dockerd, gpu_env, "sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES", env=env, opts=opts, image=image)
    assert out.returncode == 0, out.stderr
    record = seen / cidfile.read_text().strip()
    return (record.read_text().split() if record.exists() else []), out.stdout.strip()


def test_gpus_all_gives_the_toolkit_only_the_granted_gpu(gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    """`docker run --gpus all` appends NVIDIA_VISIBLE_DEVICES=all to the
    spec and adds the toolkit's prestart hook; cgpud narrows the variable
    the hook reads to the GPU it granted."""
    devices, seen = toolkit_saw(dockerd, gpu_env, ("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
    [granted] = instances(cgpud, all_=True)
    uuid_ = granted["grants"][0]["uuid"]
    assert devices == [f'"NVIDIA_VISIBLE_DEVICES={uuid_}"'] and seen == uuid_


def test_no_gpu_without_an_instance_whatever_the_image_or_docker_asks(
    tmp_path, gpu_env, rootfs_template, cgpud: Daemon, dockerd: Dockerd
) -> None:
    """The attack: no share asked, but NVIDIA_VISIBLE_DEVICES=all from the
    image (every nvidia/cuda image sets it) or from `--gpus all`. The toolkit
    honoured it and the container had every GPU with no instance, no
    libcgpu and no limit. On an isolating node the variable now reads
    "void" (the toolkit then gives nothing), and no instance is made."""
    dockerd.import_rootfs(rootfs_template, "cgpu-e2e:cuda-like", "ENV NVIDIA_VISIBLE_DEVICES=all")
    for image, gpus in (("cgpu-e2e:cuda-like", False), ("cgpu-e2e:cuda-like", True), (IMAGE, True)):
        devices, seen = toolkit_saw(dockerd, gpu_env, image=image, gpus=gpus)
        assert seen == "void", (image, gpus)
        # the toolkit's hook runs for --gpus only; every copy it reads is void
        assert set(devices) == ({'"NVIDIA_VISIBLE_DEVICES=void"'} if gpus else set()), (image, gpus, devices)
    assert instances(cgpud, all_=True) == []


def test_on_a_share_node_the_toolkit_path_is_left_as_it_is(tmp_path, gpu_env, dockerd: Dockerd) -> None:
    """share mode enforces nothing: a GPU reached through the toolkit goes
    around no limit, and the node's whole-GPU users keep it."""
    with running_daemon(tmp_path, gpu_env, "--relay-socket", str(dockerd.relay), "--mode", "share"):
        devices, seen = toolkit_saw(dockerd, gpu_env)
    assert devices == ['"NVIDIA_VISIBLE_DEVICES=all"'] and seen == "all"


def test_a_command_that_does_not_exist_leaves_no_instance(gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    """runc fails the start after cgpu's createRuntime hook bound the
    instance: Docker's error is the user's, and the instance goes."""
    out = docker_run(dockerd, gpu_env, "/no/such/program", env=("ALIYUN_COM_GPU_MEM_CONTAINER=2",))
    assert out.returncode == 127, out.stderr
    assert "/no/such/program" in out.stderr and "cgpu-runtime:" not in out.stderr, out.stderr
    assert [i["state"] for i in instances(cgpud, all_=True)] == ["released"]


def test_a_running_container_keeps_its_instance_across_a_cgpud_kill(gpu_env, cgpud: Daemon, dockerd: Dockerd) -> None:
    with detached_gpu_container(dockerd, gpu_env, 2) as (name, _):
        [before] = instances(cgpud)
        cgpud.kill()
        cgpud.start()
        [after] = instances(cgpud)
        assert (after["id"], after["state"], after["pids"]) == (before["id"], "bound", before["pids"])
        assert_exec_burn_stops_at(dockerd, name, 2)
    assert instances(cgpud) == []


def test_a_gpu_container_runs_on_with_its_limit_across_a_dockerd_restart(
    gpu_env, cgpud: Daemon, dockerd: Dockerd
) -> None:
    """With live-restore (set in the operator's daemon.json here), an
    upgrade of docker.io leaves containers running: the container keeps its
    instance, and its removal after the restart still releases it."""
    with detached_gpu_container(dockerd, gpu_env, 2) as (name, _):
        [before] = instances(cgpud)
        dockerd.restart()
        assert state(dockerd, name)["State"]["Running"]
        assert instances(cgpud) == [before]
        assert_exec_burn_stops_at(dockerd, name, 2)
    assert instances(cgpud) == []
