"""Versioned runtime files with a real cgpud: an instance's edits name the
runtime directory of the cgpud that handed them out; a cgpud of another
version installs its own next to it, keeps the old one while that instance
lives and removes it in a sweep after the release. The "other version" is the
same tree whose distribution metadata (what cgpud.__version__ reads) says
9.9.9, first on PYTHONPATH: no rebuild needed to change only the version
(tests/harness/restart_build.py makes a real newer build for the upgrade test)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from cgpud import __version__
from cgpud.containers.runtime_files import version_dir_name
from tests.harness.daemon import Daemon, make_daemon
from tests.harness.wait import until

OTHER = "9.9.9"


def _ok(d: Daemon, *args: str) -> str:
    out = d.cgpuctl(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _device_edits(d: Daemon, instance_id: str) -> dict:
    spec = json.loads(_ok(d, "cdi", "generate"))
    return next(x for x in spec["devices"] if x["name"] == instance_id)["containerEdits"]


def test_old_runtime_version_lives_as_long_as_its_instance(tmp_path, sim_env):
    current = version_dir_name(__version__)
    assert current != OTHER
    meta = tmp_path / "other-version"
    (meta / f"cgpud-{OTHER}.dist-info").mkdir(parents=True)
    (meta / f"cgpud-{OTHER}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: cgpud\nVersion: {OTHER}\n"
    )
    d = make_daemon(tmp_path, sim_env)
    runtime = d.state / "runtime"
    d.start()
    try:
        kept = _ok(d, "create", "--mem", "1GiB", "--name", "kept").strip()
        gone = _ok(d, "create", "--mem", "1GiB", "--name", "gone").strip()
        hook = Path(_device_edits(d, kept)["hooks"][-1]["path"])  # the poststop hook its container runs at stop
        assert hook == runtime / current / "cgpu-hook" and hook.is_file()
        _ok(d, "release", gone)

        d.stop()  # upgrade: the same state, a cgpud that says it is OTHER
        d.env = dict(d.env, PYTHONPATH=str(meta))
        d.start()
        assert (runtime / OTHER / "cgpu-hook").is_file()
        # New edits name the new version's files...
        assert Path(_device_edits(d, kept)["hooks"][-1]["path"]) == runtime / OTHER / "cgpu-hook"
        # ...and the old ones stay, sweep after sweep, while `kept` lives.
        time.sleep(1.0)  # five sweeps at --sweep-interval 0.2
        assert hook.is_file() and (runtime / current / "libcgpu.so").is_file()

        _ok(d, "release", kept)
        until(lambda: not (runtime / current).exists(), 10.0, interval=0.1, what="the old runtime directory to go")
        assert sorted(p.name for p in runtime.iterdir()) == [OTHER]
    finally:
        d.stop()
