"""The fuzz targets (tests/fuzz/run.py, docs/fuzzing.md) run briefly on
every test run: each must build, replay the inputs that once broke cgpu
(tests/fuzz/regressions/), and fuzz a few thousand inputs without a crash or
a broken invariant. The exec count shows the harness really ran inputs; long
campaigns are `python tests/fuzz/run.py --runs 1000000`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.fuzz import run as fuzz

# A count, not a time, so a loaded machine takes longer but never fails:
# about 2 s each here. The time bound only catches a harness gone slow.
RUNS = {"py_relay_server": 2000, "py_bundle": 2000}
C_RUNS = 4000
BOUND_SECONDS = 300


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, list[str]]:
    out = tmp_path_factory.mktemp("fuzz-bin")
    return {t.name: fuzz.build(t, out) for t in fuzz.TARGETS}


@pytest.mark.parametrize("target", fuzz.TARGETS, ids=lambda t: t.name)
def test_target_fuzzes_without_a_crash(target: fuzz.Target, commands, tmp_path: Path) -> None:
    runs = RUNS.get(target.name, C_RUNS)
    result = fuzz.run(target, commands[target.name], tmp_path, runs=runs, seconds=BOUND_SECONDS)
    log = result.log.read_text(errors="replace")
    assert not result.crashed, f"{target.name} crashed or broke an invariant:\n{log[-6000:]}"
    assert result.executed == runs, log[-3000:]
    assert result.coverage > 0


@pytest.mark.parametrize(
    "target", [t for t in fuzz.TARGETS if (fuzz.HERE / "regressions" / t.name).is_dir()], ids=lambda t: t.name
)
def test_inputs_that_once_failed_pass(target: fuzz.Target, commands, tmp_path: Path) -> None:
    inputs = sorted((fuzz.HERE / "regressions" / target.name).iterdir())
    proc = subprocess.run(
        [*commands[target.name], *map(str, inputs)],
        capture_output=True,
        text=True,
        errors="replace",
        env=fuzz.environment(tmp_path),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stderr.count("Executed ") == len(inputs)
