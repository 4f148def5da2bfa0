"""cgpuctl from exec to exit against a running cgpud, this tree against a
baseline build's cgpuctl, interleaved.

Scripts, health checks and `kubectl exec` probes run cgpuctl as a process
each time, so its start-up is most of what a verb costs. Each round runs
every verb once per side, the order of the sides alternating, against one
cgpud of this tree on a simulated GPU (the same daemon for both sides):
`list --output json` with `--socket`, `--version`, `list` against a socket
nobody listens on (the error path), and `list` without `--socket`, which
reads the settings for the socket (/etc/cgpu/config.toml, else
/run/cgpud/cgpud.sock: whatever answers there, or the error path; its
exit is not checked).

Both sides run from bytecode: without PYTHONDONTWRITEBYTECODE, an untimed
first round writes what is missing.

    .venv/bin/python -m bench.bench_cli --baseline-venv /tmp/base/.venv [--rounds 30]
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.harness import sim_environment, start_cgpud, startup_sides
from bench.table import ab_row, print_table


def verbs(sock: Path, missing: Path) -> dict[str, list[str]]:
    return {
        "list --socket": ["--socket", str(sock), "list", "--output", "json"],
        "--version": ["--version"],
        "list, nobody listening": ["--socket", str(missing), "--wait", "0", "list"],
        "list, the socket from the settings": ["--wait", "0", "list"],
    }


def once(cgpuctl: Path, args: list[str], env: dict[str, str], want_ok: bool | None) -> float:
    t0 = time.perf_counter()
    out = subprocess.run([str(cgpuctl), *args], env=env, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    if want_ok is not None and (out.returncode == 0) != want_ok:
        raise RuntimeError(f"{cgpuctl} {' '.join(args)}: exit {out.returncode}: {out.stderr.strip()[-500:]}")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    rounds, sides = startup_sides(__doc__.splitlines()[0], "cgpuctl", 30, argv)
    tmp = Path(tempfile.mkdtemp(prefix="cgpu-cli-"))
    env = sim_environment(tmp, gpus=1)
    try:
        proc, sock = start_cgpud(tmp, env)
    except OSError as e:  # no READY=1 within the minute
        print(f"cannot measure: cgpud did not start: {e!r}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
        return 1
    table = verbs(sock, tmp / "nobody.sock")
    times: dict[tuple[str, str], list[float]] = {(s, v): [] for s in sides for v in table}
    try:
        for r in range(-1, rounds):  # round -1: untimed, writes the bytecode
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for verb, verb_args in table.items():
                for side in order:
                    want = None if "settings" in verb else "nobody" not in verb
                    seconds = once(sides[side], verb_args, env, want)
                    if r >= 0:
                        times[(side, verb)].append(seconds * 1e3)
    except RuntimeError as e:
        print(f"cannot measure: {e}", file=sys.stderr)
        return 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [ab_row(verb, times[("this tree", verb)], times[("baseline", verb)]) for verb in table]
    print(f"cgpuctl exec to exit, ms, median of {rounds} interleaved rounds; load {os.getloadavg()[0]:.2f}")
    print_table(["verb", "this tree", "baseline", "this / baseline"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
