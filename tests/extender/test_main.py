"""cgpu-scheduler's command line: options it refuses before it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgpud.extender.main import main


def test_pick_at_filter_without_client_ca_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = tmp_path / "nodes"
    nodes.write_text("gpu-1 127.0.0.1:9455\n")
    code = main(["--listen", "127.0.0.1:0", "--nodes", str(nodes), "--pick-at-filter"])
    err = capsys.readouterr().err
    assert code == 2 and "cgpu-scheduler: --pick-at-filter needs --client-ca" in err, err
    assert "listening" not in err
