"""tests/intercept/programs/memory_attack.c: the tenant that tries to keep
GPU memory past its limit through the VMM API, built and driven phase by
phase (on the host, under sanitizers, or in a container)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.harness.cc import compile_strict
from tests.harness.grants import GIB

ROOT = Path(__file__).resolve().parents[2]


PROGRAM = ROOT / "tests/intercept/programs/memory_attack.c"


def build_attacker(out_dir: Path, *flags: str) -> Path:
    return compile_strict(out_dir / "memory_attack", f"-I{ROOT / 'csrc/include'}", *flags, str(PROGRAM), "-ldl")


class Phased:
    """The attacker run phase by phase: read its report, look at the GPU,
    let it go on (a line on its stdin, or with go_dir a file it polls for,
    where its stdin is not ours: in a container)."""

    def __init__(self, cmd: list[str], env: dict[str, str], go_dir: Path | None = None) -> None:
        self.go_dir = go_dir
        if go_dir is not None:
            env = dict(env, GO_DIR=str(go_dir))
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def report(self) -> dict:
        assert self.proc.stdout is not None
        while (line := self.proc.stdout.readline()) and not line.startswith("{"):
            pass
        assert line, self.proc.communicate(timeout=60)[1]
        return json.loads(line)

    def go(self, phase: int) -> None:
        if self.go_dir is not None:
            (self.go_dir / f"go{phase}").touch()
            return
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> str:
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return out


def check_vmm_sequence(run: Phased, used: Callable[[], int], limit: int = 1 * GIB) -> None:
    """The VMM attack held to a 1 GiB limit, phase by phase: `used` reads
    the GPU's resident memory as the simulated GPU counts it."""
    held = run.report()
    # Two 512 MiB creates fit; the third is the driver's own out-of-memory,
    # although every handle was released at once (its mappings keep it).
    assert held["creates"] == ["CUDA_SUCCESS"] * 2 + ["CUDA_ERROR_OUT_OF_MEMORY"] * 6
    assert held["free"] == 0
    assert used() == limit
    run.go(1)
    # One of the two mappings of each is gone: the memory is not.
    assert run.report()["free"] == 0
    assert used() == limit
    run.go(2)
    # The last unmap: the memory is gone and the limit is whole again.
    last = run.report()
    assert last["free"] == limit and last["again"] == ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    # The other order, unmapped before released: the handles hold it.
    assert run.report()["free"] == 0
    assert used() == limit
    run.go(4)
    assert run.report()["free"] == limit
    assert used() == 0
    run.finish()
