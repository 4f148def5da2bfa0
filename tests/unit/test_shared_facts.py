"""Facts cgpud shares with its C parts and its documentation, each written
once. A test per fact: each fails if one side drifted from the other, or if
Python wrote the value down again instead of reading it from C."""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

import cgpud
from cgpud import contract
from cgpud._region import ffi as region_ffi
from cgpud._region import lib as region_lib
from cgpud._scheduler import ffi as sched_ffi
from cgpud._scheduler import lib as sched_lib
from cgpud.containers import identity, relay, request
from cgpud import config
from cgpud.config import DaemonConfig
from cgpud.node.model import ComputePolicy, ComputeTiming
from cgpud.node.region import DeviceLimit, InstanceLimits, RegionError
from cgpud.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_native  # noqa: E402

MS = 1_000_000
GPU_ENV_CONFIG = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": ["PATH=/bin"]}}


def _string_literals(path: Path) -> Iterator[str]:
    """Every str constant in a module's code; docstrings are prose."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


def _restatements(*values: str) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}: {v!r}"
        for p in sorted((ROOT / "cgpud").rglob("*.py"))
        for v in _string_literals(p)
        if v in values or any(v.startswith(x + "/") for x in values)
    ]


def _bundle(tmp_path: Path, config: dict) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def _shim(native: Path, tmp_path: Path, config: dict, container_id: str = "c1") -> subprocess.CompletedProcess:
    """`cgpu-runtime create` of a bundle, with no cgpud listening: a bundle
    the shim sends to cgpud fails at once with "cgpud is not running", any
    other runs the real runtime (`true`)."""
    env = dict(
        os.environ, CGPU_REAL_RUNTIME="true", CGPU_RELAY_SOCKET=str(tmp_path / "no-cgpud.sock"), CGPU_RELAY_WAIT_MS="0"
    )
    args = [str(native / "bin/cgpu-runtime"), "create", "--bundle", str(_bundle(tmp_path, config)), container_id]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=30)


def _asked_cgpud(proc: subprocess.CompletedProcess) -> bool:
    if proc.returncode == 0:
        return False
    assert proc.returncode == 1 and "cgpud is not running" in proc.stderr, proc.stderr
    return True


# ------------------------------------------------------------ region.h


def test_region_place_and_env_come_from_region_h_and_are_written_nowhere_else(native, tmp_path):
    assert contract.CONTAINER_REGION == region_ffi.string(region_lib.CGPU_REGION_FIXED_DIR).decode()
    assert contract.REGION_ENV == region_ffi.string(region_lib.CGPU_REGION_ENV).decode()
    assert request.CONTAINER_REGION == contract.CONTAINER_REGION
    assert _restatements(contract.CONTAINER_REGION, contract.REGION_ENV) == []
    # The shim's "/cgpu" marker catches the mount cgpud reads as a claim.
    claim = dict(GPU_ENV_CONFIG, mounts=[{"destination": contract.CONTAINER_REGION, "source": "/x", "type": "bind"}])
    assert _asked_cgpud(_shim(native, tmp_path, claim))


# ------------------------------------------------------------ relay_wire.h


def test_relay_limits_come_from_relay_wire_h():
    assert (contract.RELAY_MAX_REQUEST, contract.RELAY_MSG_MAX, contract.RELAY_TIMEOUT_S) == (
        region_lib.CGPU_RELAY_MAX_REQUEST,
        region_lib.CGPU_RELAY_MSG_MAX,
        region_lib.CGPU_RELAY_TIMEOUT_S,
    )
    assert relay.READ_TIMEOUT < contract.RELAY_TIMEOUT_S  # cgpud gives up on a request before its relay does
    assert _restatements(contract.RELAY_DEFAULT_SOCKET) == []
    assert str(DaemonConfig().relay_socket) == contract.RELAY_DEFAULT_SOCKET


def test_prepares_flags_come_from_relay_wire_h():
    assert (contract.RELAY_SHIM_BINDS, contract.RELAY_SPEC_FD) == (
        region_ffi.string(region_lib.CGPU_RELAY_SHIM_BINDS).decode(),
        region_ffi.string(region_lib.CGPU_RELAY_SPEC_FD).decode(),
    )
    assert _restatements(contract.RELAY_SHIM_BINDS, contract.RELAY_SPEC_FD) == []


def test_the_gpu_shims_name_comes_from_relay_wire_h(native):
    assert contract.RUNTIME_GPU_PROGRAM == "cgpu-runtime-gpu"
    assert _restatements(contract.RUNTIME_GPU_PROGRAM) == []
    assert (native / "bin" / contract.RUNTIME_GPU_PROGRAM).is_file()  # built under the name the front looks for


@pytest.mark.parametrize("size", [contract.RELAY_MAX_REQUEST, contract.RELAY_MAX_REQUEST + 1])
def test_cgpud_reads_a_request_exactly_as_large_as_the_relays_send(size):
    server, client = socket.socketpair()
    data = b"hook poststop i1\n" + b"x" * (size - len(b"hook poststop i1\n"))

    def send() -> None:
        try:
            client.sendall(data)
        except OSError:
            pass  # cgpud stopped reading a request that is too large
        client.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        if size <= contract.RELAY_MAX_REQUEST:
            words, body = relay._read_request(server, [])
            assert words == ["hook", "poststop", "i1"] and len(body) == size - len(b"hook poststop i1\n")
        else:
            with pytest.raises(relay.RelayProtocolError, match=str(contract.RELAY_MAX_REQUEST)):
                relay._read_request(server, [])
    finally:
        server.close()
        sender.join()
        client.close()


def test_a_long_answer_reaches_the_user_through_the_real_relay(native, tmp_path):
    path = tmp_path / "relay.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    reason = "no GPU has room " + "é" * contract.RELAY_MSG_MAX

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(65536):
                pass
            conn.sendall(relay.answer_line(f"error {reason}"))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        proc = subprocess.run(
            [str(native / "bin/cgpu-hook"), "--socket", str(path), "--instance", "i1", "poststop"],
            input=b"{}",
            capture_output=True,
            timeout=30,
        )
    finally:
        server.join(10)
        listener.close()
    err = proc.stderr.decode()
    assert proc.returncode == 1 and err.startswith("cgpu-hook: no GPU has room é"), err
    assert len(relay.answer_line(f"error {reason}")) <= contract.RELAY_MSG_MAX


def test_container_id_limit_is_the_shims(native, tmp_path):
    longest, too_long = "c" * contract.CONTAINER_ID_MAX, "c" * (contract.CONTAINER_ID_MAX + 1)
    gpu = dict(GPU_ENV_CONFIG, process={"env": [f"{request.ENV_MEMORY}=1"]})
    assert identity.CONTAINER_ID.fullmatch(longest) and not identity.CONTAINER_ID.fullmatch(too_long)
    assert _asked_cgpud(_shim(native, tmp_path, gpu, longest))
    refused = _shim(native, tmp_path, gpu, too_long)
    assert refused.returncode == 1 and "container id is not valid" in refused.stderr
    assert f"1-{contract.CONTAINER_ID_MAX} " in refused.stderr


def test_instance_id_limit_is_what_a_region_and_the_hook_hold(native, tmp_path):
    longest, too_long = "i" * contract.INSTANCE_ID_MAX, "i" * (contract.INSTANCE_ID_MAX + 1)
    assert request._INSTANCE_ID.fullmatch(longest) and not request._INSTANCE_ID.fullmatch(too_long)
    gpu = (DeviceLimit("GPU-0", 1 << 30, 0),)
    InstanceLimits(longest, gpu)
    with pytest.raises(RegionError, match="instance id"):
        InstanceLimits(too_long, gpu)

    def hook(instance: str) -> subprocess.CompletedProcess:
        args = [
            str(native / "bin/cgpu-hook"),
            "--socket",
            str(tmp_path / "none.sock"),
            "--instance",
            instance,
            "poststop",
        ]
        return subprocess.run(
            args, input="{}", capture_output=True, text=True, timeout=30, env=dict(os.environ, CGPU_RELAY_WAIT_MS="0")
        )

    assert hook(longest).returncode == 1 and "cgpud is not running" in hook(longest).stderr
    assert hook(too_long).returncode == 2 and f"1-{contract.INSTANCE_ID_MAX} characters" in hook(too_long).stderr


# ------------------------------------------------------------ the version


def test_relays_print_the_package_version(native):
    assert build_native.package_version() == cgpud.__version__
    env = dict(os.environ, CGPU_REAL_RUNTIME="true")
    shim = subprocess.run(
        [str(native / "bin/cgpu-runtime"), "--version"], env=env, capture_output=True, text=True, timeout=30
    )
    assert shim.stdout.splitlines()[0] == f"cgpu-runtime {cgpud.__version__}"
    hook = subprocess.run([str(native / "bin/cgpu-hook"), "--version"], capture_output=True, text=True, timeout=30)
    assert hook.stdout == f"cgpu-hook {cgpud.__version__}\n"


# ------------------------------------------------------------ the env prefix


def test_request_env_names_start_with_the_shims_prefix():
    assert contract.ENV_PREFIX == region_ffi.string(region_lib.CGPU_ENV_PREFIX).decode()
    for name in (*request.REQUEST_ENV, request.ENV_VISIBLE):
        assert name.startswith(contract.ENV_PREFIX + "_"), name


@pytest.mark.parametrize("name", [*request.REQUEST_ENV, request.ENV_VISIBLE])
def test_the_shim_sends_a_bundle_asking_by_any_request_env_to_cgpud(native, tmp_path, name):
    spec = dict(GPU_ENV_CONFIG, process={"args": ["sh"], "env": ["PATH=/bin", f"{name}=1"]})
    assert _asked_cgpud(_shim(native, tmp_path, spec))
    assert not _asked_cgpud(_shim(native, tmp_path, GPU_ENV_CONFIG))  # the same bundle without it does not ask


# ------------------------------------------------------------ scheduler.h


def test_scheduler_limits_are_the_cores():
    assert config.MAX_SCHEDULED == sched_lib.CGPU_SCHED_MAX_TENANTS
    s = sched_ffi.gc(sched_lib.cgpu_sched_create(1), sched_lib.cgpu_sched_destroy)
    tiny = config.SLICE_MS[0]
    cases = [
        (config.PERIOD_MS[0], tiny),
        (config.PERIOD_MS[1], tiny),
        (config.PERIOD_MS[0] - 0.001, tiny),
        (config.PERIOD_MS[1] + 0.001, tiny),
        (100.0, config.SLICE_MS[0]),
        (100.0, config.SLICE_MS[1]),
        (100.0, config.SLICE_MS[0] - 0.001),
        (100.0, config.SLICE_MS[1] + 0.001),
    ]
    for period_ms, slice_ms in cases:
        cfg = DaemonConfig(compute_period_ms=period_ms, compute_slice_ms=slice_ms)
        try:
            config.validate(cfg)
            cgpud_ok = True
        except UsageError as e:
            cgpud_ok = False
            assert re.search(r"between [\d.]+ and [\d.]+", str(e)), e
        t = cfg.timing()
        # Soft is the policy whose bound cgpud applies to all.
        core_ok = sched_lib.cgpu_sched_configure(s, 0, ComputePolicy.SOFT, t.period_ns, t.max_slice_ns, 0) == 0
        assert cgpud_ok == core_ok, (period_ms, slice_ms)
    with pytest.raises(UsageError, match=f"between {config.SLICE_MS[0]:g} and {config.SLICE_MS[1]:g}"):
        config.validate(DaemonConfig(compute_slice_ms=config.SLICE_MS[1] * 2))


def test_compute_policies_are_the_cores_enum():
    core = sched_ffi.typeof("enum cgpu_sched_policy").relements
    assert {f"CGPU_SCHED_{p.name}": int(p) for p in ComputePolicy} == core


def test_default_timing_is_the_cores():
    s = sched_ffi.gc(sched_lib.cgpu_sched_create(1), sched_lib.cgpu_sched_destroy)
    cfg = sched_ffi.new("struct cgpu_sched_config *")
    assert sched_lib.cgpu_sched_config_get(s, 0, cfg) == 0
    timing = DaemonConfig().timing()
    assert (timing.period_ns, timing.max_slice_ns) == (cfg.period_ns, cfg.max_slice_ns)
    assert ComputeTiming() == timing


# ------------------------------------------------------------ the documentation


def _documented_settings() -> dict[str, object]:
    text = (ROOT / "docs/operations.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.DOTALL)
    assert block, "docs/operations.md lost its table of settings"
    return tomllib.loads(block.group(1))


def test_every_setting_is_documented_with_its_default():
    documented = _documented_settings()
    defaults = DaemonConfig()
    kinds = config._types()
    assert set(documented) == {f.name for f in fields(DaemonConfig)}
    for name, value in documented.items():
        assert config._convert(name, kinds[name], value) == getattr(defaults, name), name
    numbering = ", ".join(f"{int(p)} {p.name.lower()}" for p in ComputePolicy)
    assert numbering in (ROOT / "docs/operations.md").read_text()
    # docs/compute.md names the timing settings with their defaults in prose.
    prose = re.findall(r"`(\w+)` \(([\d.]+)[;)]", (ROOT / "docs/compute.md").read_text())
    named = {n: v for n, v in prose if n in documented}
    assert {"compute_period_ms", "compute_slice_ms", "high_priority_percent"} <= set(named)
    for name, value in named.items():
        assert float(value) == getattr(defaults, name), name
