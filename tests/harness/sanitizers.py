"""The C parts built with AddressSanitizer and UBSan, and how sanitized
programs are run and judged. A build takes minutes on these machines, so
conftest.py files expose it through session-scoped fixtures over
shared_build: one build per run, whichever modules and workers ask for it."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_native  # noqa: E402
import pytest  # noqa: E402

from tests.harness.builds import built  # noqa: E402

SAN_OPTIONS = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=86",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87",
}
# Python itself leaks at exit by design: leak checking is for the C tools.
PYTHON_ASAN_OPTIONS = "detect_leaks=0:abort_on_error=0:exitcode=86"
RELAYS = ("bin/cgpu-runtime", "bin/cgpu-runtime-gpu", "bin/cgpu-hook")


def build(out: Path, outputs: Sequence[str] | None = None) -> Path:
    """Builds the sanitized variant of every target (or of those whose
    output is listed) into out; returns out."""
    targets = build_native.TARGETS if outputs is None else tuple(t for t in build_native.TARGETS if t.output in outputs)
    build_native.build_all(out, build_native.SANITIZE, targets)
    return out


def shared_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sanitized build of every target, made once per run (builds.built)."""
    return built(tmp_path_factory, "sanitize", build)


@functools.cache
def asan_runtime() -> str:
    """The compiler's libasan.so, which must come first in a preload list."""
    return subprocess.run(
        ["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()


def san_env(sim_env: dict[str, str], san_native: Path) -> dict[str, str]:
    """sim_env with the sanitized simulated driver and the sanitizer options."""
    return dict(sim_env, **SAN_OPTIONS, LD_LIBRARY_PATH=str(san_native / "sim"))


def python_env(san_env: dict[str, str]) -> dict[str, str]:
    """For a Python that loads sanitized libraries: the ASan runtime preloaded."""
    return dict(san_env, LD_PRELOAD=asan_runtime(), ASAN_OPTIONS=PYTHON_ASAN_OPTIONS)


def instance_env(san_env: dict[str, str], san_native: Path, region: Path) -> dict[str, str]:
    """A process in an instance (2 GiB of simulated GPU 0) enforced by the
    sanitized libcgpu.so."""
    from cgpud.node.region import DeviceLimit, InstanceLimits, write_region

    write_region(region, InstanceLimits("san", (DeviceLimit("GPU-5c1a0000-0000-4000-8000-000000c90000", 2 << 30, 0),)))
    preload = f"{asan_runtime()}:{san_native / 'lib' / 'libcgpu.so'}"
    return dict(san_env, LD_PRELOAD=preload, CGPU_REGION_DIR=str(region))


def assert_clean(stderr: str) -> None:
    assert "Sanitizer" not in stderr and "runtime error" not in stderr, stderr


def run_clean(
    cmd: list[str], env: dict[str, str], stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Runs cmd to its end; no sanitizer report may appear on its stderr."""
    proc = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout)
    assert_clean(proc.stderr)
    return proc
