"""The relays on the container start path, cgpu-runtime and cgpu-hook, held to
the relay wire protocol. The peer is a real unix socket server playing cgpud's
side (it records each request and answers a scripted line); the "real runtime"
is a script that records its argv. Every test runs against the release build
and against an AddressSanitizer/UBSan build of the two relays."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
from pathlib import Path

import pytest

from cgpud import __version__
from cgpud.contract import INSTANCE_ID_MAX
from tests.harness.relay import GPU_CONFIG, Cgpud, INSTANCE, PLAIN_CONFIG, STATE, bundle, create_args, relay_env, run

REFUSAL = "asked for 17 GiB of GPU memory but no GPU on this node has 17 GiB free"
MIB = 1 << 20


# --- cgpu-runtime: commands that never involve cgpud ----------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["state", "c1"],
        ["start", "c1"],
        ["delete", "--force", "c1"],
        ["kill", "c1", "KILL"],
        ["--root", "/run/runc", "--log", "/dev/null", "--log-format", "json", "state", "c1"],
        ["--debug", "--systemd-cgroup", "exec", "--tty", "c1", "sh"],
        ["ps", "--format", "json", "c1"],
        ["--root", "create", "state", "c1"],  # "create" is --root's value, not the command
    ],
)
def test_other_commands_go_to_the_runtime_unchanged_without_cgpud(bins, env, runtime, tmp_path, args):
    # cwd holds a GPU bundle and no cgpud listens: touching either would fail the call.
    proc = run(bins / "cgpu-runtime", args, env, cwd=bundle(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert runtime.argv == args and proc.stdout == "fake-runc ran\n"


def test_version_names_the_shim_then_the_runtime(bins, env, runtime):
    proc = run(bins / "cgpu-runtime", ["--version"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"cgpu-runtime {__version__}\nfake-runc ran\n" and runtime.argv == ["--version"]


@pytest.mark.parametrize("command", ["create", "run"])
def test_bundle_without_gpu_markers_never_reaches_cgpud(bins, env, runtime, cgpud, tmp_path, command):
    server = cgpud()
    b = bundle(tmp_path, config=PLAIN_CONFIG)
    args = ["--root", "/run/runc", command, "--bundle", str(b), "--pid-file", str(tmp_path / "pid"), "c1"]
    proc = run(bins / "cgpu-runtime", args, env)
    assert proc.returncode == 0, proc.stderr
    assert runtime.argv == args and server.requests == []


# --- cgpu-runtime: create/run of a bundle that may ask for a GPU ----------------------------------

GLOBALS = ["--root", "/run/containerd/runc/k8s.io", "--log", "{log}", "--log-format", "json"]


@pytest.mark.parametrize("command", ["create", "run"])
@pytest.mark.parametrize(
    ("form", "cwd"),
    [
        (["--bundle", "{abs}"], None),
        (["--bundle={abs}"], None),
        (["-b", "{abs}"], None),
        (["-b={abs}"], None),
        (["-bundle", "{abs}"], None),
        (["--bundle", "bundles/c1"], "root"),
        ([], "bundle"),
    ],
)
def test_prepare_request_names_the_container_and_absolute_bundle(
    bins, env, runtime, cgpud, tmp_path, command, form, cwd
):
    server = cgpud()
    b = bundle(tmp_path)
    glob = [a.format(log=tmp_path / "log.json") for a in GLOBALS]
    opts = ["--console-socket", "/run/c.sock", "--pid-file", str(tmp_path / "pid"), "--no-pivot", "--detach"]
    args = [*glob, command, *[a.format(abs=b) for a in form], *opts, "c1"]
    proc = run(bins / "cgpu-runtime", args, env, cwd={"root": tmp_path, "bundle": b, None: None}[cwd])
    assert proc.returncode == 0, proc.stderr
    # create --pid-file: the shim binds and releases itself, so it asks for no hooks.
    flag = b" shim-binds" if command == "create" else b""
    assert server.requests == [b"prepare c1" + flag + b"\n" + os.path.realpath(b).encode()]
    assert runtime.argv == args and not (tmp_path / "log.json").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--log=/dev/null", "--log-format=json", "--systemd-cgroup", "create", "-b", "{b}", "c1"],
        ["create", "c1", "--bundle", "{b}"],  # runc's CLI library lets flags follow the id
        ["create", "--bundle", "{b}", "--", "c1"],
        ["--", "create", "--bundle", "{b}", "c1"],
    ],
)
def test_prepare_finds_id_and_bundle_wherever_runc_accepts_them(bins, env, runtime, cgpud, tmp_path, args):
    server = cgpud()
    b = bundle(tmp_path)
    args = [a.format(b=b) for a in args]
    proc = run(bins / "cgpu-runtime", args, env)
    assert proc.returncode == 0, proc.stderr
    assert server.requests == [b"prepare c1\n" + str(b).encode()] and runtime.argv == args


@pytest.mark.parametrize(
    "config",
    [
        GPU_CONFIG,
        json.dumps({"mounts": [{"destination": "/run/cgpu", "source": "/var/lib/cgpud/x", "type": "bind"}]}),
        # JSON escapes could spell a marker that a byte scan would miss.
        '{"process":{"env":["ALIYUN\\u005fCOM_GPU_MEM_CONTAINER=2"]}}',
        '{"mounts":[{"destination":"\\/run\\/cgpu"}]}',
        # cgpud reads these as claims of /run/cgpu as well (found by tests/fuzz py_bundle)
        *(
            json.dumps({"mounts": [{"destination": d, "source": "/var/lib/cgpud/x", "type": "bind"}]})
            for d in ("/run/cgpu/", "/run//cgpu", "/run/./cgpu/usage")
        ),
        # a marker straddling two reads of the scan
        *(" " * (65536 - k) + GPU_CONFIG for k in (1, 8, 13, 20, 40)),
        " " * (8 * MIB + 1),  # too large to scan: cgpud decides
    ],
    ids=[
        "env",
        "mount",
        "u-escape",
        "slash-escape",
        "mount-slash",
        "mount-2slash",
        "mount-under",
        "cut1",
        "cut8",
        "cut13",
        "cut20",
        "cut40",
        "huge",
    ],
)
def test_any_marker_sends_the_bundle_to_cgpud(bins, env, runtime, cgpud, tmp_path, config):
    server = cgpud(b"ok prepared 1 GPU\n")
    b = bundle(tmp_path, config=config)
    proc = run(bins / "cgpu-runtime", ["create", "--bundle", str(b), "c1"], env)
    assert proc.returncode == 0, proc.stderr
    assert len(server.requests) == 1 and runtime.argv is not None


@pytest.mark.parametrize(
    "config",
    [
        # Go's encoder (containerd, dockerd) escapes & < > on its own.
        '{"process":{"args":["sh","-c","a \\u0026\\u0026 b \\u003e /dev/null"]}}',
        '{"process":{"env":["NOTE=\\u00e9t\\u00e9"]}}',
    ],
    ids=["go-escapes", "accents"],
)
def test_escapes_an_encoder_writes_itself_stay_on_the_fast_path(bins, env, runtime, tmp_path, config):
    b = bundle(tmp_path, config=config)
    args = ["create", "--bundle", str(b), "c1"]
    proc = run(bins / "cgpu-runtime", args, env)  # no cgpud listening: it must not be asked
    assert proc.returncode == 0, proc.stderr
    assert runtime.argv == args


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_refusal_stops_the_start_and_reaches_containerd_through_the_log(bins, env, runtime, cgpud, tmp_path, fmt):
    server = cgpud(f"error {REFUSAL}\n".encode())
    b = bundle(tmp_path)
    log = tmp_path / "log.json"
    log.write_text('{"level":"info","msg":"earlier line","time":"2024-01-01T00:00:00Z"}\n')
    args = ["--root", "/r", "--log", str(log), "--log-format", fmt, "create", "--bundle", str(b), "c1"]
    proc = run(bins / "cgpu-runtime", args, env)
    assert proc.returncode == 1 and runtime.argv is None and len(server.requests) == 1
    assert proc.stderr == f"cgpu-runtime: {REFUSAL}\n"
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith('earlier line","time":"2024-01-01T00:00:00Z"}')
    if fmt == "json":
        entry = json.loads(lines[1])
        assert entry["level"] == "error" and entry["msg"] == f"cgpu-runtime: {REFUSAL}"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", entry["time"])
    else:
        assert re.fullmatch(rf'time="\d{{4}}-[-0-9T:]+Z" level=error msg="cgpu-runtime: {REFUSAL}"', lines[1])


def test_log_entry_escapes_the_message(bins, env, runtime, cgpud, tmp_path):
    cgpud(b'error bad "name" \\ \x01\tend\n')
    log = tmp_path / "log.json"
    args = ["--log", str(log), "--log-format", "json", "create", "-b", str(bundle(tmp_path)), "c1"]
    proc = run(bins / "cgpu-runtime", args, env)
    assert proc.returncode == 1 and runtime.argv is None
    # control characters never reach the terminal or the log
    assert json.loads(log.read_text())["msg"] == 'cgpu-runtime: bad "name" \\   end'


def test_unreachable_cgpud_fails_closed_and_names_the_socket(bins, env, runtime, sock_path, tmp_path):
    log = tmp_path / "log"
    args = ["--log", str(log), "create", "--bundle", str(bundle(tmp_path)), "c1"]
    proc = run(bins / "cgpu-runtime", args, env)
    msg = (
        f"cgpu-runtime: cgpud is not running ({sock_path}: No such file or directory): start it (systemctl start cgpud)"
    )
    assert proc.returncode == 1 and runtime.argv is None and proc.stderr == msg + "\n"
    assert log.read_text().endswith(f'level=error msg="{msg}"\n')


def test_socket_without_listener_is_unreachable(bins, env, runtime, sock_path, tmp_path):
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock_path))
    dead.close()
    proc = run(bins / "cgpu-runtime", ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)
    assert proc.returncode == 1 and runtime.argv is None
    assert proc.stderr == (
        f"cgpu-runtime: cgpud is not running ({sock_path}: Connection refused): start it (systemctl start cgpud)\n"
    )


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (None, "cgpud went away without answering ({sock}: connection closed): start it (systemctl start cgpud)"),
        (b"ok", "cgpud sent an incomplete answer on {sock}"),
        (b"okay\n", "cgpud sent an unexpected answer on {sock}: okay"),
        (b"OK\n", "cgpud sent an unexpected answer on {sock}: OK"),
        (b"error\n", "cgpud refused without giving a reason (on {sock})"),
        (b"x" * 5000, "cgpud sent an answer longer than 4096 bytes on {sock}"),
    ],
)
def test_anything_but_an_answer_line_is_a_failure(bins, env, runtime, cgpud, sock_path, tmp_path, answer, message):
    cgpud(answer)
    proc = run(bins / "cgpu-runtime", ["create", "--bundle", str(bundle(tmp_path)), "c1"], env)
    assert proc.returncode == 1 and runtime.argv is None
    assert proc.stderr == "cgpu-runtime: " + message.format(sock=sock_path) + "\n"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "missing", "no-bundle"])
def test_unreadable_config_is_left_to_the_runtime(bins, env, runtime, cgpud, tmp_path, kind):
    server = cgpud()
    b = bundle(tmp_path, config=None)
    config = b / "config.json"
    if kind == "symlink":
        # The target asks for a GPU: following the link would reach cgpud.
        (tmp_path / "elsewhere.json").write_text(GPU_CONFIG)
        config.symlink_to(tmp_path / "elsewhere.json")
    elif kind == "fifo":
        os.mkfifo(config)
    elif kind == "directory":
        config.mkdir()
    elif kind == "no-bundle":
        b = tmp_path / "absent"
    args = ["create", "--bundle", str(b), "c1"]
    proc = run(bins / "cgpu-runtime", args, env)
    assert proc.returncode == 0, proc.stderr
    assert runtime.argv == args and server.requests == []


@pytest.mark.parametrize("args", [["create", "--bundle", "{b}"], ["create", "--bundle", "{b}", "bad\nid"]])
def test_gpu_bundle_without_a_usable_id_is_refused(bins, env, runtime, cgpud, tmp_path, args):
    server = cgpud()
    b = bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", [a.format(b=b) for a in args], env)
    assert proc.returncode == 1 and runtime.argv is None and server.requests == []
    assert proc.stderr.startswith("cgpu-runtime: container id ") and proc.stderr.count("\n") == 1


def test_runtime_that_cannot_run_fails_closed(bins, env, runtime, tmp_path):
    log = tmp_path / "log"
    env["CGPU_REAL_RUNTIME"] = str(tmp_path / "no-such-runc")
    proc = run(bins / "cgpu-runtime", ["--log", str(log), "--log-format", "json", "state", "c1"], env)
    msg = (
        f"cgpu-runtime: cannot run {tmp_path}/no-such-runc: No such file or directory"
        " (install runc or set CGPU_REAL_RUNTIME)"
    )
    assert proc.returncode == 127 and proc.stderr == msg + "\n"
    assert json.loads(log.read_text())["msg"] == msg


@pytest.mark.parametrize("name", ["runc", "my-runc"])
def test_runtime_is_found_on_path_by_name(bins, env, runtime, name):
    runtime.path.rename(runtime.path.with_name(name))
    env["PATH"] = f"{runtime.path.parent}:{env['PATH']}"
    if name == "runc":
        del env["CGPU_REAL_RUNTIME"]
    else:
        env["CGPU_REAL_RUNTIME"] = name
    proc = run(bins / "cgpu-runtime", ["state", "c1"], env)
    assert proc.returncode == 0, proc.stderr
    assert runtime.argv == ["state", "c1"]


# --- cgpu-hook ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [["--socket", "{sock}", "--instance", "inst-1.a_b"], ["--instance=inst-1.a_b", "--socket={sock}"]],
)
def test_hook_forwards_the_state_byte_exactly(bins, hook_env, cgpud, sock_path, opts):
    server = cgpud()
    args = [o.format(sock=sock_path) for o in opts] + ["createRuntime"]
    proc = run(bins / "cgpu-hook", args, hook_env, cwd="/", stdin=STATE)
    assert proc.returncode == 0 and proc.stdout == proc.stderr == ""
    assert server.requests == [b"hook createRuntime inst-1.a_b\n" + STATE]


def test_hook_accepts_ok_with_text(bins, hook_env, cgpud, sock_path):
    cgpud(b"ok nothing to do\n")
    proc = run(bins / "cgpu-hook", ["--socket", str(sock_path), "--instance", "i1", "poststop"], hook_env, stdin=STATE)
    assert proc.returncode == 0 and proc.stderr == ""


def test_hook_reports_the_refusal(bins, hook_env, cgpud, sock_path):
    cgpud(b"error instance i1 is unknown to cgpud\n")
    proc = run(bins / "cgpu-hook", ["--socket", str(sock_path), "--instance", "i1", "prestart"], hook_env, stdin=STATE)
    assert proc.returncode == 1 and proc.stderr == "cgpu-hook: instance i1 is unknown to cgpud\n"


def test_hook_without_answer_fails(bins, hook_env, cgpud, sock_path):
    server = cgpud(None)
    args = ["--socket", str(sock_path), "--instance", "i1", "createRuntime"]
    proc = run(bins / "cgpu-hook", args, hook_env, stdin=STATE)
    assert proc.returncode == 1 and proc.stderr == (
        f"cgpu-hook: cgpud went away without answering ({sock_path}: connection closed): "
        "start it (systemctl start cgpud)\n"
    )
    assert len(server.requests) == 1


def test_hook_with_cgpud_down_names_the_socket(bins, hook_env, sock_path):
    args = ["--socket", str(sock_path), "--instance", "i1", "createRuntime"]
    proc = run(bins / "cgpu-hook", args, hook_env, stdin=STATE)
    assert proc.returncode == 1
    msg = f"cgpu-hook: cgpud is not running ({sock_path}: No such file or directory): start it (systemctl start cgpud)"
    assert proc.stderr == msg + "\n"


def test_hook_default_socket(bins, hook_env):
    proc = run(bins / "cgpu-hook", ["--instance", "i1", "createRuntime"], hook_env, stdin=STATE)
    assert proc.returncode == 1 and "(/run/cgpud/relay.sock: " in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "missing STAGE"),
        (["createRuntime"], "missing --instance"),
        (["--instance", "i1"], "missing STAGE"),
        (["--instance", "a b", "prestart"], "--instance must be"),
        (["--instance", "x" * (INSTANCE_ID_MAX + 1), "prestart"], "--instance must be"),
        (["--instance", "../x", "prestart"], "--instance must be"),
        (["--instance=", "prestart"], "--instance must be"),
        (["--instance", "i1", "create-runtime"], "STAGE must be"),
        (["--instance", "i1", "prestart", "extra"], "unexpected argument extra"),
        (["--instance", "i1", "--bogus", "prestart"], "unknown option --bogus"),
        (["--instance"], "--instance needs a value"),
        (["--socket", "relay.sock", "--instance", "i1", "prestart"], "--socket must be an absolute path"),
    ],
)
def test_hook_usage_errors_exit_2_without_contacting_cgpud(bins, hook_env, cgpud, sock_path, args, needle):
    server = cgpud()
    proc = run(bins / "cgpu-hook", ["--socket", str(sock_path), *args], hook_env, stdin=STATE)
    assert proc.returncode == 2 and proc.stderr.startswith(f"cgpu-hook: {needle}"), proc.stderr
    assert "usage: cgpu-hook" in proc.stderr and server.requests == []


def test_hook_accepts_the_longest_instance_id(bins, hook_env, cgpud, sock_path):
    server = cgpud()
    instance = "A" * INSTANCE_ID_MAX
    args = ["--socket", str(sock_path), "--instance", instance, "poststop"]
    proc = run(bins / "cgpu-hook", args, hook_env, stdin=b"{}")
    assert proc.returncode == 0 and server.requests == [f"hook poststop {instance}\n{{}}".encode()]


@pytest.mark.parametrize("stdin", [b"", b"  \n\t", b"nope", b"[1]", b"\0{}"])
def test_hook_rejects_non_json_state_without_contacting_cgpud(bins, hook_env, cgpud, sock_path, stdin):
    server = cgpud()
    proc = run(bins / "cgpu-hook", ["--socket", str(sock_path), "--instance", "i1", "prestart"], hook_env, stdin=stdin)
    assert proc.returncode == 1 and server.requests == []
    assert proc.stderr == "cgpu-hook: expected the OCI container state (a JSON object) on stdin\n"


def test_hook_state_up_to_the_request_limit(bins, hook_env, cgpud, sock_path):
    server = cgpud()
    head = b"hook prestart i1\n"
    args = ["--socket", str(sock_path), "--instance", "i1", "prestart"]
    fits = b"{" + b" " * (MIB - len(head) - 2) + b"}"
    proc = run(bins / "cgpu-hook", args, hook_env, stdin=fits)
    assert proc.returncode == 0, proc.stderr
    assert server.requests == [head + fits] and len(server.requests[0]) == MIB
    proc = run(bins / "cgpu-hook", args, hook_env, stdin=fits + b" ")
    assert proc.returncode == 1 and "container state larger than" in proc.stderr
    assert len(server.requests) == 1


@pytest.mark.parametrize("args", [["--version"], ["--socket", "/x.sock", "--version"]])
def test_hook_version(bins, hook_env, args):
    proc = run(bins / "cgpu-hook", args, hook_env)
    assert proc.returncode == 0 and proc.stdout == "cgpu-hook 0.1.0\n"


# --- cgpu-runtime binding and releasing itself (create --pid-file, delete) ------------------------
# Against a scripted cgpud and a fake runc: the requests it sends, the pid
# file read as hostile input, the real runtime's exit code passed through,
# and a failed bind undone with `delete --force`.


class ShimRunc:
    """A fake runc: logs each call's argv as one line; `create` writes
    $FAKE_PID into the --pid-file (raw, as a lying runtime could) and exits
    $FAKE_CREATE_RC; `delete` removes <root>/<id> as runc removes its state."""

    def __init__(self, path: Path) -> None:
        self.path, self.log = path, path.with_suffix(".log")
        path.write_text(f"""#!/bin/sh
echo "$*" >> {shlex.quote(str(self.log))}
root=""; pidf=""; cmd=""; last=""
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root="$2"; shift;;
    --pid-file) pidf="$2"; shift;;
    create|delete) [ -z "$cmd" ] && cmd="$1";;
    *) last="$1";;
  esac
  shift
done
if [ "$cmd" = create ]; then
  [ "${{FAKE_CREATE_RC:-0}}" = 0 ] || exit "$FAKE_CREATE_RC"
  mkdir -p "$root/$last"
  [ -n "$FAKE_PID_LINK" ] && ln -s "$FAKE_PID_LINK" "$pidf" || printf '%s' "$FAKE_PID" > "$pidf"
fi
[ "$cmd" = delete ] && rm -rf "$root/$last"
exit 0
""")
        path.chmod(0o755)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def fake(tmp_path: Path) -> ShimRunc:
    (tmp_path / "rt").mkdir()
    return ShimRunc(tmp_path / "rt" / "runc")


@pytest.fixture
def shim_env(fake: ShimRunc, sock_path: Path, tmp_path: Path) -> dict[str, str]:
    return relay_env(fake.path, sock_path)


def bodies(requests: list[bytes]) -> list[tuple[str, dict | str]]:
    out = []
    for r in requests:
        head, _, body = r.decode().partition("\n")
        out.append((head, json.loads(body) if body.startswith("{") else body))
    return out


def test_create_binds_the_pid_and_delete_is_the_runtimes_alone(bins, cgpud, fake, shim_env, tmp_path) -> None:
    server = cgpud(f"ok instance {INSTANCE}\n".encode())
    b = bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), dict(shim_env, FAKE_PID="4242\n"))
    assert proc.returncode == 0, proc.stderr
    assert bodies(server.requests) == [
        ("prepare c1 shim-binds spec-fd", str(b)),
        (f"bind {INSTANCE}", {"ociVersion": "1.0.2", "id": "c1", "bundle": str(b), "status": "created", "pid": 4242}),
    ]
    # cgpud releases when the init it bound exits: delete asks it nothing.
    gone = run(bins / "cgpu-runtime", ["--root", str(tmp_path / "root"), "delete", "c1"], shim_env)
    assert gone.returncode == 0, gone.stderr
    assert len(server.requests) == 2
    assert fake.calls()[1:] == [f"--root {tmp_path / 'root'} delete c1"]


@pytest.mark.parametrize("pid", ["0", "1", "-5", "+7", "12x", "", "99999999999999999999999", "4242 4243", "link"])
def test_a_pid_file_that_is_not_a_pid_undoes_the_create(bins, cgpud, fake, shim_env, tmp_path, pid) -> None:
    server = cgpud(f"ok instance {INSTANCE}\n".encode())
    b = bundle(tmp_path)
    env = dict(shim_env, FAKE_PID=pid)
    if pid == "link":  # a symlink to a file that holds a fine pid: not followed
        (tmp_path / "elsewhere").write_text("4242\n")
        env["FAKE_PID_LINK"] = str(tmp_path / "elsewhere")
    log = tmp_path / "runc.log"
    proc = run(bins / "cgpu-runtime", ["--log", str(log), *create_args(tmp_path, b)], env)
    assert proc.returncode == 1
    assert "cannot read the init pid of container c1" in proc.stderr
    assert "cannot read the init pid of container c1" in log.read_text()  # where containerd looks
    assert [h for h, _ in bodies(server.requests)] == ["prepare c1 shim-binds spec-fd", f"release {INSTANCE}"]
    assert fake.calls()[-1] == f"--log {log} --root {tmp_path / 'root'} delete --force c1"
    assert not (tmp_path / "root" / "c1").exists()


class Scripted(Cgpud):
    """cgpud answering each request with the next line of a script."""

    def __init__(self, path: Path, answers: list[str]) -> None:
        self._answers = [a.encode() for a in answers]
        super().__init__(path, None)

    @property
    def answer(self) -> bytes | None:  # read after the request is recorded
        n = len(getattr(self, "requests", []))
        return self._answers[n - 1] if 0 < n <= len(self._answers) else None

    @answer.setter
    def answer(self, value: bytes | None) -> None:
        pass


def test_a_refused_bind_undoes_the_create(bins, fake, shim_env, tmp_path, sock_path) -> None:
    server = Scripted(sock_path, [f"ok instance {INSTANCE}\n", "error instance belongs to container x\n", "ok\n"])
    try:
        b = bundle(tmp_path)
        proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), dict(shim_env, FAKE_PID="4242"))
    finally:
        server.close()
    assert proc.returncode == 1 and "cgpu-runtime: instance belongs to container x" in proc.stderr
    assert [h for h, _ in bodies(server.requests)] == [
        "prepare c1 shim-binds spec-fd",
        f"bind {INSTANCE}",
        f"release {INSTANCE}",
    ]
    assert fake.calls()[-1] == f"--root {tmp_path / 'root'} delete --force c1"
    assert not (tmp_path / "root" / "c1").exists()


def test_the_real_runtimes_failure_is_its_exit_code_and_frees_the_instance(
    bins, cgpud, fake, shim_env, tmp_path
) -> None:
    server = cgpud(f"ok instance {INSTANCE}\n".encode())
    b = bundle(tmp_path)
    proc = run(bins / "cgpu-runtime", create_args(tmp_path, b), dict(shim_env, FAKE_CREATE_RC="3"))
    assert proc.returncode == 3
    assert [h for h, _ in bodies(server.requests)] == ["prepare c1 shim-binds spec-fd", f"release {INSTANCE}"]


def test_run_and_create_without_pid_file_keep_the_hooks(bins, cgpud, fake, shim_env, tmp_path) -> None:
    server = cgpud(f"ok instance {INSTANCE}\n".encode())
    b = bundle(tmp_path)
    for args in (["create", "--bundle", str(b), "c1"], ["run", "--bundle", str(b), "--pid-file", "p", "c1"]):
        proc = run(bins / "cgpu-runtime", ["--root", str(tmp_path / "root"), *args], shim_env)
        assert proc.returncode == 0, proc.stderr
    assert [h for h, _ in bodies(server.requests)] == ["prepare c1", "prepare c1"]
