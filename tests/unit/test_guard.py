"""The SIGBUS guard (csrc/region/guard.c) as a real process built with ASan
and UBSan: a mapped file truncated under a registered mapping reads as
zeros and is marked damaged; a fault anywhere else reaches the handler that
was there before and still kills with SIGBUS."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAN = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
ENV = {"ASAN_OPTIONS": "detect_leaks=1:exitcode=86", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87"}


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("guard") / "guard_driver"
    cmd = [
        "cc",
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        *SAN,
        f"-I{ROOT / 'csrc/region'}",
        str(Path(__file__).with_name("guard_driver.c")),
        str(ROOT / "csrc/region/guard.c"),
        "-o",
        str(out),
        "-lpthread",
    ]
    subprocess.run(cmd, check=True)
    return out


def test_a_truncated_registered_mapping_reads_zeros_and_is_marked_damaged(driver: Path) -> None:
    proc = subprocess.run([str(driver)], env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_fault_outside_every_registered_mapping_still_kills(driver: Path) -> None:
    proc = subprocess.run([str(driver), "unguarded"], env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr)
    assert "previous handler" in proc.stderr  # chained, not replaced


# Both cffi modules of cgpud map usage files, each with its own copy of the
# guard; whichever installs second sees the first as the previous handler.
COMPOSED = r"""
import os, sys
from pathlib import Path
from cgpud.node.compute import ComputeScheduler
from cgpud.node.model import ComputePolicy, Grant, Instance, InstanceState, NodePolicy, Owner, OwnerKind
from cgpud.node.region import USAGE_FILE, DeviceLimit, InstanceLimits, UsageRegion, write_region
from tests.harness.wait import until

root, order = Path(sys.argv[1]), sys.argv[2]
for name in ("engine", "python"):
    write_region(root / name, InstanceLimits(name, (DeviceLimit("GPU-x", 1 << 30, 0, 50),)), gated=True)
sched = ComputeScheduler(1)
sched.configure(NodePolicy(compute_policy=ComputePolicy.FIXED))
tenant = Instance("engine", Owner(OwnerKind.PROCESS, "engine"), (Grant(0, "GPU-x", 1 << 30, 50),),
                  InstanceState.RESERVED, True)
if order == "scheduler-first":
    sched.attach(tenant, root / "engine")
    usage = UsageRegion(root / "python")
else:
    usage = UsageRegion(root / "python")
    sched.attach(tenant, root / "engine")
sched.start()
os.truncate(root / "python" / USAGE_FILE, 0)
assert usage._u.device[0].used == 0 and usage.damaged  # no SIGBUS in Python's own read
os.truncate(root / "engine" / USAGE_FILE, 0)
# The scheduler's loop reads the file every slice.
until(lambda: sched.damaged("engine"), timeout=30, interval=0.01, what="the engine to meet the truncated file")
sched.stop()
print("ok")
"""


@pytest.mark.parametrize("order", ["scheduler-first", "region-first"])
def test_the_guards_of_both_cgpud_modules_compose(tmp_path: Path, order: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", COMPOSED, str(tmp_path), order], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-3000:])
