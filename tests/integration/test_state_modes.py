"""Host-side state is root's alone: a host user other than root opens none
of cgpud's files, even where an installer or an older cgpud left the state
directory 0755. Containers reach their region files through bind mounts,
which do not cross these directories (tests/e2e/test_security.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgpud import __version__
from cgpud.containers.runtime_files import version_dir_name
from tests.harness.daemon import BIN, Daemon, make_daemon
from tests.harness.wait import until

NOBODY = 65534


def opened_as_nobody(paths: list[Path]) -> list[str]:
    """Which paths a child process running as nobody (no groups) can open,
    and how."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root for good, then try
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            opened = []
            for path in paths:
                for flags, how in ((os.O_RDONLY, "read"), (os.O_RDWR, "write")):
                    try:
                        os.close(os.open(path, flags))
                        opened.append(f"{how} {path}")
                    except OSError:
                        pass
            os.write(w, json.dumps(opened).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.fixture
def open_state(tmp_path: Path, sim_env: dict[str, str]) -> Iterator[tuple[Daemon, Path]]:
    """cgpud with its state in a directory every user can reach, made 0755
    beforehand as a package or an older cgpud would leave it."""
    top = Path(tempfile.mkdtemp(prefix="cgpu-modes-"))
    try:
        top.chmod(0o755)
        d = make_daemon(tmp_path, sim_env)
        state = top / "state"
        state.mkdir(mode=0o755)
        state.chmod(0o755)
        d.args[d.args.index("--state-dir") + 1] = str(state)
        d.state = state
        d.start()
        try:
            yield d, state
        finally:
            d.stop()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_no_host_user_but_root_opens_any_state_file(open_state: tuple[Daemon, Path]) -> None:
    d, state = open_state
    run, region = _hold_instance(d)
    try:
        files = [p for p in state.rglob("*") if p.is_file() and not p.is_symlink()]
        assert region / "usage" in files and state / "cgpud.db" in files
        assert os.getuid() == 0 and os.stat(region / "usage").st_mode & 0o002  # the test means something
        assert opened_as_nobody(files) == []
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "instances").stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "cgpud.db").stat().st_mode) == 0o600
        # What containers open through their mounts keeps the mode they need.
        assert stat.S_IMODE(region.stat().st_mode) == 0o755
        assert stat.S_IMODE((region / "usage").stat().st_mode) == 0o666
        assert stat.S_IMODE((state / "runtime" / version_dir_name(__version__) / "libcgpu.so").stat().st_mode) == 0o755
    finally:
        run.terminate()
        run.wait(timeout=60)
    assert os.path.isdir(state)


def _hold_instance(d: Daemon) -> tuple[subprocess.Popen[bytes], Path]:
    run = subprocess.Popen(
        [str(BIN / "cgpuctl"), "--socket", str(d.socket), "run", "--mem", "1GiB", "--", "sleep", "600"],
        env=d.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def region() -> Path | None:
        listing = json.loads(d.cgpuctl("list", "--output", "json").stdout or "[]")
        # Listed once committed; its files come just after.
        if listing and (usage := d.state / "instances" / listing[0]["id"] / "usage").exists():
            return usage.parent
        return None

    try:
        return run, until(region, timeout=60, interval=0.05, what="the instance and its region")
    except BaseException:
        run.terminate()
        raise


def _doctor(d: Daemon, tmp_path: Path) -> str:
    settings = tmp_path / "doctor.toml"
    settings.write_text(f'state_dir = "{d.state}"\n')
    return d.cgpuctl("doctor", "--config", str(settings)).stdout


def test_each_region_is_a_small_tmpfs_of_its_own_gone_with_its_instance(daemon: Daemon, tmp_path: Path) -> None:
    run, region = _hold_instance(daemon)
    try:
        assert region.is_mount()
        st = os.statvfs(region)
        assert st.f_blocks * st.f_frsize < 1 << 20  # a tenant fills this, and nothing else
        assert "ok    instance regions: 1 on a tmpfs of their own" in _doctor(daemon, tmp_path)
    finally:
        run.terminate()
        run.wait(timeout=60)
    for _ in range(600):  # released by cgpuctl run, or by the sweep
        if not region.exists():
            break
        time.sleep(0.05)
    assert not region.exists()
    assert str(region) not in Path("/proc/self/mountinfo").read_text()


def test_without_cap_sys_admin_regions_are_plain_and_doctor_says_so(tmp_path: Path, sim_env: dict[str, str]) -> None:
    d = make_daemon(tmp_path, sim_env)
    # cgpud as root without CAP_SYS_ADMIN, as in a container or under a
    # restrictive unit: it cannot mount.
    real = BIN / "cgpud"
    wrapper = tmp_path / "cgpud-nocap"
    wrapper.write_text(f'#!/bin/sh\nexec setpriv --bounding-set -sys_admin --inh-caps -sys_admin {real} "$@"\n')
    wrapper.chmod(0o755)
    _start_with(d, str(wrapper))
    try:
        run, region = _hold_instance(d)
        try:
            assert not region.is_mount()
            report = _doctor(d, tmp_path)
            assert "warn  instance regions: 1 of 1 instance regions are plain directories" in report, report
            assert "Operation not permitted" in report and "CAP_SYS_ADMIN" in report
            assert d.log.read_text().count("instance regions are plain directories") == 1
        finally:
            run.terminate()
            run.wait(timeout=60)
    finally:
        d.stop()


def _start_with(d: Daemon, binary: str) -> None:
    """Daemon.start, through another executable."""
    with open(d.log, "a") as log:
        d.proc = subprocess.Popen([binary, *d.args], env=d.env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    d.wait_for(b"READY=1")
