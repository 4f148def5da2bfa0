"""tests/cuda/spin.cu built by a CUDA line's nvcc (tests/harness/cudakit.py),
and the step reports it prints, read into a dict."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.harness import cudakit

ROOT = Path(__file__).resolve().parents[2]


def build_spin(
    out: Path, compress: str, code: str = "compute_75", cudart: str = "shared", *flags: str, line: str = cudakit.DEFAULT
) -> Path:
    """spin.cu as PTX only (compute_75) or as machine code (sm_80), the
    fatbin compressed as asked, with the shared or static runtime, by the
    given line's nvcc."""
    kit = cudakit.toolkit(line)
    arch = code.replace("sm_", "compute_")
    proc = subprocess.run(
        [
            str(kit.nvcc),
            "-gencode",
            f"arch={arch},code={code}",
            *kit.nvcc_link_flags(cudart),
            f"--compress-mode={compress}",
            *flags,
            "-o",
            str(out),
            str(ROOT / "tests/cuda/spin.cu"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def steps(exe: Path, env: dict[str, str], *args: str, prefix: tuple[str, ...] = ()) -> dict[str, list[str]]:
    proc = subprocess.run([*prefix, str(exe), *args], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        name, *rest = line.split()
        out.setdefault(name, rest)  # the first report of a step
        out[name + "@last"] = rest
    return out
