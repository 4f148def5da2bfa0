"""Who may use cgpud's admin socket: root, and no other uid, even one that
can get past the socket's file modes. The client is a real cgpuctl process
run as another uid."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from tests.harness.daemon import BIN, Daemon

NOBODY = 65534


def as_nobody(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """cgpuctl as uid 65534 holding CAP_DAC_OVERRIDE: past every file mode
    (the socket's, its directory's, the interpreter's under /root), but not
    root."""
    cmd = [
        "setpriv",
        f"--reuid={NOBODY}",
        f"--regid={NOBODY}",
        "--clear-groups",
        "--inh-caps=+dac_override",
        "--ambient-caps=+dac_override",
        "--",
        str(BIN / "cgpuctl"),
        "--socket",
        str(daemon.socket),
        *args,
    ]
    return subprocess.run(cmd, env=daemon.env, capture_output=True, text=True, timeout=120)


def test_a_non_root_client_is_refused_and_root_is_served(daemon: Daemon) -> None:
    refused = as_nobody(daemon, "create", "--mem", "1GiB")
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines() == [
        f"cgpuctl: cgpud refused this client: only root may use {daemon.socket} "
        f"(the connecting process runs as uid {NOBODY})"
    ]
    assert as_nobody(daemon, "list").returncode != 0
    assert "refused a non-root admin client" in daemon.log.read_text()
    # Nothing was created, and root is served as before.
    out = daemon.cgpuctl("list", "--all", "--output", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    assert daemon.cgpuctl("create", "--mem", "1GiB").returncode == 0


def test_the_grpc_server_behind_the_gate_is_out_of_reach(daemon: Daemon) -> None:
    private = daemon.socket.parent / ".api" / daemon.socket.name
    assert stat.S_ISSOCK(private.lstat().st_mode)
    assert stat.S_IMODE(private.parent.lstat().st_mode) == 0o700
    assert stat.S_IMODE(daemon.socket.lstat().st_mode) == 0o600
    # The gRPC server itself never sees a non-root peer: file modes alone
    # guard it, and only a root process (the gate) is meant to get there.
    code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(private)!r})"
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert out.returncode != 0 and "PermissionError" in out.stderr, out.stderr
