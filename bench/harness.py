"""What several benchmarks do the same way: a private simulated machine, a
real cgpud started on it and waited for (READY=1 on a notify socket), a free
TCP port (the tests' own), the exit of a benchmark that could not measure,
and the two sides of a start-up benchmark."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from cgpud.native import native_dir
from tests.harness.net import free_port  # noqa: F401  (re-exported for the benchmarks)

BIN = Path(sys.executable).parent
H100 = 'gpu name="NVIDIA H100 80GB HBM3" mem=80GiB sms=132\n'


class BenchError(Exception):
    """The benchmark could not run; the message says what failed."""


def exit_with(prog: str, main: Callable[[list[str]], int]) -> NoReturn:
    """Runs `main` on the command line's arguments and exits with its code;
    a BenchError exits 1 with its message (bench/README.md)."""
    try:
        sys.exit(main(sys.argv[1:]))
    except BenchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(1)


def sim_environment(tmp: Path, gpus: int = 2) -> dict[str, str]:
    """The environment of a process on `gpus` simulated H100s whose
    configuration and state live in `tmp`."""
    config = tmp / "sim.conf"
    config.write_text(H100 * gpus)
    return dict(
        os.environ,
        LD_LIBRARY_PATH=str(native_dir() / "sim"),
        CGPU_SIM_CONFIG=str(config),
        CGPU_SIM_STATE=str(tmp / "sim.state"),
    )


def start_cgpud(tmp: Path, env: dict[str, str], *flags: str) -> tuple[subprocess.Popen[bytes], Path]:
    """A cgpud with its state, settings (none) and socket in `tmp` and
    `flags` added, once it says READY=1; returns it and its API socket."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify"))
    sock = tmp / "run" / "cgpud.sock"
    (tmp / "empty.toml").write_text("")
    proc = subprocess.Popen(
        [
            str(BIN / "cgpud"),
            "--config",
            str(tmp / "empty.toml"),
            "--state-dir",
            str(tmp / "state"),
            "--socket",
            str(sock),
            *flags,
        ],
        env=dict(env, NOTIFY_SOCKET=str(tmp / "notify")),
        stderr=subprocess.DEVNULL,
    )
    notify.settimeout(60)
    while b"READY=1" not in notify.recv(4096):
        pass
    notify.close()
    return proc, sock


def startup_sides(
    description: str, program: str, rounds: int, argv: Sequence[str] | None
) -> tuple[int, dict[str, Path]]:
    """`--rounds` and `--baseline-venv` of a benchmark that times how a
    program starts: the rounds and each side's `program` ("this tree"
    first). Start-up is mostly imports, so the processes started from here
    on may write bytecode (PYTHONDONTWRITEBYTECODE dropped): a side without
    .pyc files would compile every module every time."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--baseline-venv", type=Path, required=True, help="another build's virtual environment")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    baseline = args.baseline_venv / "bin" / program
    if not baseline.exists():
        p.error(f"{baseline} does not exist: --baseline-venv names a virtual environment with cgpu installed")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return args.rounds, {"this tree": BIN / program, "baseline": baseline}
