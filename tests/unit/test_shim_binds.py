"""cgpud's side of the shim binding itself: a `prepare ... shim-binds`
writes no hook entries (and drops those of an earlier prepare of the same
bundle), and the shim's `bind`/`release` requests do what the createRuntime
and poststop hooks do, with the same checks. Real instance service."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cgpud.errors import StateError, UsageError
from cgpud.containers.relay import RelayProtocolError, handle
from tests.unit.test_container_identity import bundle, lifecycle, state

GPU = "ALIYUN_COM_GPU_MEM_CONTAINER=2"


def hooks_of(b: Path) -> dict:
    return json.loads((b / "config.json").read_text()).get("hooks", {})


def test_shim_binds_prepare_writes_no_hooks_and_drops_earlier_ones(tmp_path: Path) -> None:
    lc, _ = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    assert handle(lc, ["prepare", "job"], str(b).encode()).startswith("instance ")
    assert set(hooks_of(b)) == {"createRuntime", "poststop"}
    # A retried create of the same bundle, now by a shim that binds itself.
    assert handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).startswith("instance ")
    assert hooks_of(b) == {}


def test_shim_binds_keeps_hooks_that_are_not_cgpus(tmp_path: Path) -> None:
    lc, _ = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    spec = json.loads((b / "config.json").read_text())
    theirs = {"path": "/usr/bin/other-hook", "args": ["other-hook"]}
    spec["hooks"] = {"poststop": [theirs]}
    (b / "config.json").write_text(json.dumps(spec))
    handle(lc, ["prepare", "job", "shim-binds"], str(b).encode())
    assert hooks_of(b) == {"poststop": [theirs]}


def test_bind_and_release_requests_do_the_hooks_work(tmp_path: Path) -> None:
    lc, svc = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    iid = handle(lc, ["prepare", "job", "shim-binds"], str(b).encode()).split()[-1]
    assert handle(lc, ["bind", iid], state("job", b, os.getpid())) == f"bound {iid}"
    assert svc.get(iid).pids == (os.getpid(),)
    with pytest.raises(UsageError, match="no init pid"):
        handle(lc, ["bind", iid], state("job", b))
    # Another container's bind or release changes nothing.
    other = bundle(tmp_path / "other", GPU)
    with pytest.raises(StateError, match="belongs to container"):
        handle(lc, ["bind", iid], state("job", other, os.getpid()))
    assert "not" in handle(lc, ["release", iid], state("job", other))
    assert svc.get(iid).state.value == "bound"
    assert handle(lc, ["release", iid], state("job", b)) == f"released {iid}"
    assert svc.get(iid).state.value == "released"


def test_prepare_takes_only_the_shim_binds_flag(tmp_path: Path) -> None:
    lc, _ = lifecycle(tmp_path)
    b = bundle(tmp_path / "b", GPU)
    with pytest.raises(RelayProtocolError):
        handle(lc, ["prepare", "job", "no-hooks-please"], str(b).encode())
    assert "hooks" not in json.loads((b / "config.json").read_text())
