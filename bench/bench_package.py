"""The deb and rpm: their sizes, how long the deb takes to install, and how
long cgpud from the package takes from exec to READY=1 against cgpud from
the source tree (the venv).

  sizes          deb, rpm, and the installed tree (a dpkg --root install)
  install        `dpkg --root <empty root> -i` of the deb, fresh root each round
  start-to-ready /usr/bin/cgpud (the package, installed on this machine with
                 dpkg -i for the run and purged after) and .venv/bin/cgpud,
                 interleaved round by round, each with a fresh state dir on one
                 simulated GPU: Popen to READY=1 on a notify socket
  interpreter    the package's CPython (built by zig for glibc 2.17) against
                 the venv's base interpreter on one pure-Python and stdlib
                 workload (WORKLOAD), interleaved round by round

Prints medians and the ratios package/source and package/venv's base. A report: exit 0 whether or not
a figure pleases, 1 when it could not measure, 2 on a bad argument. Needs
root, dpkg-deb and rpmbuild; refuses to run when a cgpu package is already
installed (it would not be this tree's).

Run from the repository root:
    .venv/bin/python -m bench.bench_package [--rounds 7] [--install-rounds 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.table import print_table
from cgpud.native import native_path
from tests.harness.sim import write_sim_config
from tests.harness.daemon import BIN

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.1.0+bench"
PACKAGED_SIM = Path(f"/opt/cgpu/{VERSION}/python/lib/python3.11/site-packages/cgpud/_native/sim")
PACKAGED_PYTHON = Path(f"/opt/cgpu/{VERSION}/python/bin/python3.11")


# What a daemon's interpreter spends its time on, roughly: JSON, SQLite,
# plain Python arithmetic and hashing. Prints its own elapsed seconds.
WORKLOAD = """
import hashlib, json, sqlite3, time
t = time.perf_counter()
doc = {"a": [{"k": i, "v": str(i) * 3} for i in range(2000)]}
for _ in range(40):
    json.loads(json.dumps(doc))
db = sqlite3.connect(":memory:")
db.execute("create table t(a, b)")
db.executemany("insert into t values (?, ?)", [(i, str(i)) for i in range(100000)])
db.execute("select sum(a) from t").fetchone()
s = 0
for i in range(2000000):
    s += i * i % 7
hashlib.sha256(b"x" * 50_000_000).hexdigest()
print(time.perf_counter() - t)
"""


class CannotMeasure(RuntimeError):
    pass


def workload_seconds(python: Path) -> float:
    out = _run(python, "-I", "-c", WORKLOAD)
    return float(out.stdout)


def _run(*args: str | Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise CannotMeasure(f"{' '.join(map(str, args))}: {out.stderr[-2000:]}")
    return out


def build(tmp: Path) -> tuple[Path, Path, float]:
    start = time.monotonic()
    out = _run(
        sys.executable,
        ROOT / "packaging" / "build.py",
        "--version",
        VERSION,
        "--out",
        tmp / "dist",
        "--work",
        tmp / "work",
    )
    paths = [Path(p) for p in out.stdout.split()]
    deb = next(p for p in paths if p.suffix == ".deb")
    rpm = next(p for p in paths if p.suffix == ".rpm")
    return deb, rpm, time.monotonic() - start


def install_into_root(deb: Path, root: Path) -> float:
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates"):
        (root / d).mkdir(parents=True)
    for f in ("status", "available"):
        (root / "var/lib/dpkg" / f).touch()
    start = time.monotonic()
    _run("dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends", "--log=/dev/null", "-i", deb)
    return time.monotonic() - start


def tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def start_to_ready(cgpud: Path, sim_lib: Path, tmp: Path, extra: Sequence[str] = ()) -> float:
    """Seconds from cgpud's exec to READY=1 on one simulated GPU, in a fresh
    state dir under `tmp` (made here); `extra`: more cgpud arguments."""
    tmp.mkdir()
    env = dict(
        os.environ,
        LD_LIBRARY_PATH=str(sim_lib),
        CGPU_SIM_CONFIG=str(write_sim_config(tmp / "sim.conf", 1)),
        CGPU_SIM_STATE=str(tmp / "sim.state"),
        NOTIFY_SOCKET=str(tmp / "notify"),
    )
    (tmp / "none.toml").write_text("")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp / "notify"))
        notify.settimeout(60)
        start = time.monotonic()
        with open(tmp / "log", "w") as log:
            proc = subprocess.Popen(
                [
                    str(cgpud),
                    "--config",
                    str(tmp / "none.toml"),
                    "--state-dir",
                    str(tmp / "state"),
                    "--socket",
                    str(tmp / "run" / "cgpud.sock"),
                    "--relay-socket",
                    str(tmp / "run" / "relay.sock"),
                    *extra,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        try:
            while True:
                try:
                    data = notify.recv(4096)
                except TimeoutError:
                    raise CannotMeasure(f"{cgpud}: no READY=1: {(tmp / 'log').read_text()[-2000:]}") from None
                if b"READY=1" in data.split(b"\n"):
                    ready = time.monotonic() - start
                    break
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    return ready


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="start-to-ready rounds (each runs both)")
    p.add_argument("--install-rounds", type=int, default=5)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.install_rounds < 1:
        p.error("rounds must be at least 1")
    if os.geteuid() != 0:
        print("bench_package: needs root (dpkg -i)", file=sys.stderr)
        return 1
    if subprocess.run(["dpkg-query", "-W", "cgpu"], capture_output=True).returncode == 0:
        print("bench_package: a cgpu package is installed already; purge it first", file=sys.stderr)
        return 1
    installed = False
    try:
        with tempfile.TemporaryDirectory(prefix="bench-package-") as t:
            tmp = Path(t)
            deb, rpm, build_s = build(tmp)
            deb_bytes, rpm_bytes = deb.stat().st_size, rpm.stat().st_size
            installs = [install_into_root(deb, tmp / f"root{i}") for i in range(args.install_rounds)]
            installed_bytes = tree_size(tmp / "root0")
            _run("dpkg", "-i", deb)
            installed = True
            package, source = [], []
            for i in range(args.rounds):
                package.append(start_to_ready(Path("/usr/bin/cgpud"), PACKAGED_SIM, tmp / f"pkg{i}"))
                source.append(start_to_ready(BIN / "cgpud", native_path("sim/libcuda.so.1").parent, tmp / f"src{i}"))
            bundled, base = [], []
            for _ in range(args.rounds):
                bundled.append(workload_seconds(PACKAGED_PYTHON))
                base.append(workload_seconds(Path(sys.base_prefix) / "bin" / "python3"))
    except CannotMeasure as e:
        print(f"bench_package: {e}", file=sys.stderr)
        return 1
    finally:
        if installed:
            subprocess.run(["dpkg", "--purge", "cgpu"], capture_output=True)
    mib = 1024 * 1024
    print_table(
        ("figure", "value"),
        [
            ("deb size", f"{deb_bytes / mib:.1f} MiB"),
            ("rpm size", f"{rpm_bytes / mib:.1f} MiB"),
            ("installed tree", f"{installed_bytes / mib:.1f} MiB"),
            ("build both (staging included)", f"{build_s:.1f} s"),
            (f"dpkg -i into a root, median of {len(installs)}", f"{statistics.median(installs):.2f} s"),
        ],
    )
    print()
    pm, sm = statistics.median(package), statistics.median(source)
    print_table(
        ("cgpud start to READY=1", f"median of {args.rounds}", "min", "max"),
        [
            (
                "package (/usr/bin/cgpud)",
                f"{pm * 1000:.0f} ms",
                f"{min(package) * 1000:.0f} ms",
                f"{max(package) * 1000:.0f} ms",
            ),
            (
                "source tree (.venv/bin/cgpud)",
                f"{sm * 1000:.0f} ms",
                f"{min(source) * 1000:.0f} ms",
                f"{max(source) * 1000:.0f} ms",
            ),
        ],
    )
    print(f"\npackage / source: {pm / sm:.2f}\n")
    bm, vm = statistics.median(bundled), statistics.median(base)
    print_table(
        ("interpreter, WORKLOAD", f"median of {args.rounds}", "min", "max"),
        [
            (
                f"package ({PACKAGED_PYTHON.name}, zig, glibc 2.17)",
                f"{bm:.3f} s",
                f"{min(bundled):.3f} s",
                f"{max(bundled):.3f} s",
            ),
            (f"venv's base ({sys.base_prefix})", f"{vm:.3f} s", f"{min(base):.3f} s", f"{max(base):.3f} s"),
        ],
    )
    print(f"\npackage / venv's base: {bm / vm:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
