"""The SIGBUS guard (csrc/region/guard.c) as a real process built with ASan
and UBSan: a mapped file truncated under a registered mapping reads as
zeros and is marked damaged; a fault anywhere else reaches the handler that
was there before and still kills with SIGBUS."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAN = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
ENV = {"ASAN_OPTIONS": "detect_leaks=1:exitcode=86", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87"}


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("guard") / "guard_driver"
    cmd = ["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", *SAN, f"-I{ROOT / 'csrc/region'}",
           str(Path(__file__).with_name("guard_driver.c")), str(ROOT / "csrc/region/guard.c"), "-o", str(out),
           "-lpthread"]
    subprocess.run(cmd, check=True)
    return out


def test_a_truncated_registered_mapping_reads_zeros_and_is_marked_damaged(driver: Path) -> None:
    proc = subprocess.run([str(driver)], env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_fault_outside_every_registered_mapping_still_kills(driver: Path) -> None:
    proc = subprocess.run([str(driver), "unguarded"], env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr)
    assert "previous handler" in proc.stderr  # chained, not replaced
