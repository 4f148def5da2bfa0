"""Container start latency with cgpu-runtime and cgpu-hook against plain runc.

Times `runc create` + `runc start` + the wait for the container's exit +
`runc delete` of a busybox container that runs `true`, seven ways, in a fresh
random order within each round of one run:

  runc    / non-GPU   plain runc, a bundle that asks for no GPU
  shim    / non-GPU   the same bundle, every command through cgpu-runtime
  runc    / GPU 2 GiB the bundle with ALIYUN_COM_GPU_MEM_CONTAINER=2, plain runc
                      (the request is there but nobody acts on it)
  shim    / GPU 2 GiB that bundle through cgpu-runtime: cgpud prepares it
                      (instance created, config.json rewritten, no hooks), the
                      shim binds after `create`; cgpud releases the instance
                      when the init exits, and `delete` is a plain exec
  hooks   / GPU 2 GiB the CDI / hooks.d path: plain runc runs the bundle as
                      cgpud's hook-mode prepare left it (the same edits its CDI
                      spec carries: mounts, env, the createRuntime hook); the
                      prepare happens untimed before the start,
                      as a device plugin's Allocate does before containerd
                      applies the CDI spec, so the timed part is exactly what
                      an engine that only runs hooks pays: runc's hook runs
  shim    / GPU floor the GPU bundle through cgpu-runtime against a relay
                      socket that answers every request at once and does
                      nothing (no instance, config.json untouched): what the
                      shim's GPU path costs by itself (its exec, the fork of
                      runc create, two round trips to a Python socketserver
                      like cgpud's), for information: the difference to
                      `shim / GPU 2 GiB` is cgpud's own work
  hooks   / GPU floor the hooks' bundle with the cgpu-hook entry replaced
                      by `true`: what runc's running of a hook costs by
                      itself, for information (the instance is released
                      after the timed part)

A real cgpud (its own state dir and sockets, on one simulated 16 GiB GPU)
serves the shim. Prints the median and p90 of each variant, each step's
median (create, start, the wait for the exit, delete) with what it added
over plain runc, the time added
at the median and at p90 against plain runc on the same request bundle, the
targets (<= 1 ms non-GPU; <= 3 ms median and <= 10 ms p90 GPU), ratios and
paired per-round differences, then checks that cgpud has no active
instance left.

Each runtime command is waited for with a pidfd, not subprocess's timeout
loop: that loop polls with sleeps doubling from 0.5 ms, so a command that
took 33 ms was seen at 63.5 ms, and it made up the whole tail earlier
versions of this benchmark reported (bench/README.md).

It is a report: the exit status is 0 whether or not a target is met, 1 when
it could not measure (setup error, a failed runc command, an instance left
behind), 2 on a bad argument. Needs root, runc and busybox-static.

Run from the repository root:
    .venv/bin/python -m bench.bench_container_start [--rounds 100] [--warmup 2] [--quick]
        [--baseline-tree DIR] [--only KEY,...]
`--only shim-gpu,shim-gpu-base` is a focused A/B of two builds' shim path
(with plain runc beside): three variants, so twice the rounds in the time.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import select
import shlex
import shutil
import socket
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import BenchError, exit_with
from bench.table import print_table
from cgpud.native import native_dir, native_path
from tests.harness.sim import write_sim_config
from tests.harness.daemon import Daemon, make_daemon
from tests.harness.oci import Bundle, Host, MissingTool, build_rootfs, default_spec, require_tools, runtime_env

ROOT = Path(__file__).resolve().parent.parent
GPU_REQUEST = "ALIYUN_COM_GPU_MEM_CONTAINER=2"
RUN_TIMEOUT_S = 60
PR_SET_CHILD_SUBREAPER = 36
QUICK_ROUNDS = 5
DAEMON_SWEEP_INTERVAL = "2"  # cgpud's default (the e2e tests use 0.2 s)
TRUE = shutil.which("true") or "/bin/true"

# (key, label, shim, gpu, hooks: plain runc on a hook-mode prepared bundle)
FLOOR = "shim-floor"  # the shim against InstantRelay instead of cgpud
HOOK_FLOOR = "hook-floor"  # the hook bundle, its cgpu-hook entries running `true`
VARIANTS = (
    ("runc-plain", "runc, non-GPU", False, False, False),
    ("shim-plain", "shim, non-GPU", True, False, False),
    ("runc-gpu", "runc, GPU 2 GiB (env only)", False, True, False),
    ("shim-gpu", "shim, GPU 2 GiB", True, True, False),
    ("hook-gpu", "runc + hooks (CDI), GPU 2 GiB", False, True, True),
    (FLOOR, "shim, GPU, relay doing nothing", True, True, False),
    (HOOK_FLOOR, "runc + hooks doing nothing (true)", False, True, True),
)
# --baseline-tree: the GPU paths again, through the other checkout's cgpud and binaries.
BASELINE_VARIANTS = (
    ("shim-gpu-base", "shim, GPU 2 GiB, --baseline-tree", True, False),
    ("hook-gpu-base", "runc + hooks (CDI), GPU 2 GiB, --baseline-tree", False, True),
)
# (label, baseline key, measured key, target ms added at the median, at p90 or None) -- from the issues:
# the GPU medians are issue 39's 3 ms (they were 5 ms before it).
TARGETS = (
    ("non-GPU container", "runc-plain", "shim-plain", 1.0, None),
    ("GPU container (2 GiB), shim", "runc-gpu", "shim-gpu", 3.0, 10.0),
    ("GPU container (2 GiB), CDI/hooks", "runc-gpu", "hook-gpu", 3.0, 10.0),
)
# Shown where both variants ran: (label, from key, to key).
AGAINST_BASELINE = (
    ("shim, GPU 2 GiB", "shim-gpu-base", "shim-gpu"),
    ("runc + hooks (CDI), GPU 2 GiB", "hook-gpu-base", "hook-gpu"),
)
PARTS = (
    ("shim: itself, against a relay doing nothing", "runc-gpu", FLOOR),
    ("shim: cgpud's work (prepare, bind, the release at the exit) on top of that", FLOOR, "shim-gpu"),
    ("hooks: runc running a hook that does nothing (true)", "runc-gpu", HOOK_FLOOR),
    ("hooks: cgpu-hook and cgpud's work (bind, the release at the exit) on top of that", HOOK_FLOOR, "hook-gpu"),
)


# The timed steps, each from the end of the one before: where an added millisecond lies.
PHASES = ("create", "start", "exit", "delete")


class InstantRelay:
    """A relay socket that answers the shim's prepare and bind (and release) at
    once and does nothing: the same transport as cgpud's (a socketserver
    answering on its accepting thread, one connection per request), none of
    its work. It counts
    what it was asked, so the run can check that the shim took its GPU path."""

    INSTANCE = "cgpu-000000000000"

    def __init__(self, path: Path) -> None:
        self.asked: dict[str, int] = {"prepare": 0, "bind": 0, "release": 0}
        asked = self.asked
        instance = self.INSTANCE

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data = b""
                while chunk := self.request.recv(65536):
                    data += chunk
                verb = data.split(b"\n", 1)[0].split(b" ", 1)[0].decode(errors="replace")
                answer = {
                    "prepare": f"ok instance {instance}",
                    "bind": f"ok bound {instance}",
                    "release": f"ok released {instance}",
                }.get(verb, f"error unknown request {verb!r}")
                asked[verb] = asked.get(verb, 0) + 1
                self.request.sendall(answer.encode() + b"\n")

        self._server = socketserver.UnixStreamServer(str(path), Handler)
        threading.Thread(target=self._server.serve_forever, name="instant-relay", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Variant:
    key: str
    label: str
    shim: bool
    gpu: bool
    hooks: bool
    bundle: Bundle
    config: bytes  # config.json as written, restored before each start
    env: dict[str, str]
    argv0: str
    ms: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    daemon: Daemon | None = None  # the cgpud it talks to, when not the run's own (--baseline-tree)

    def median(self) -> float:
        return statistics.median(self.ms)

    def p90(self) -> float:
        ordered = sorted(self.ms)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    def spread(self) -> float:
        if len(self.ms) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.ms, n=4, method="inclusive")
        return q3 - q1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=100, help="timed starts per variant, interleaved (100)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (2)")
    p.add_argument("--seed", type=int, default=1, help="seed of the per-round shuffle of the variants (1)")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK_ROUNDS} rounds, 1 warm-up round")
    p.add_argument(
        "--bundles-on",
        choices=("tmpfs", "disk"),
        default="tmpfs",
        help="where the bundles, their rootfs, runc's state and cgpud's sockets live: tmpfs of the "
        "run's own (tmpfs, the default), as under /run where containerd, Docker and CRI-O keep them "
        "and cgpud its sockets (/run/cgpud) on a host; or the temp directory's filesystem (disk). "
        "cgpud's state directory stays on the temp directory's filesystem, as /var/lib/cgpud does",
    )
    p.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="another built checkout (a git worktree with its C parts built in place and the "
        "generated gRPC modules; bench/README.md says how): its cgpud, shim and hook run beside "
        "this tree's, as two more variants, and the report adds this tree minus that one, paired",
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="wait this long after the hook variants' untimed prepare before the timed create (0): "
        "with a device plugin the prepare (Allocate) comes well before the container's create, so "
        "cgpud's work after answering it (the next spare region) is over by then",
    )
    p.add_argument(
        "--only",
        metavar="KEY[,KEY...]",
        help="only these variants, and plain runc with the GPU bundle that they are measured against: "
        "more rounds of the few that matter in the same time (keys as printed each round, "
        "e.g. shim-gpu,shim-gpu-base)",
    )
    args = p.parse_args(argv)
    keys = {k for k, *_ in VARIANTS} | {k for k, *_ in BASELINE_VARIANTS}
    if args.only is not None:
        args.only = {k.strip() for k in args.only.split(",") if k.strip()} | {"runc-gpu"}
        if args.only - keys:
            p.error(f"--only: no variant {', '.join(sorted(args.only - keys))}; the keys are {', '.join(sorted(keys))}")
        if args.only & {k for k, *_ in BASELINE_VARIANTS} and args.baseline_tree is None:
            p.error("--only: the *-base variants need --baseline-tree")
    if args.quick:
        args.rounds, args.warmup = QUICK_ROUNDS, 1
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be at least 1 and --warmup at least 0")
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        for part in ("cgpud/daemon/main.py", "cgpud/_native/bin/cgpu-runtime", "cgpud/api/cgpu/v1/local_pb2.py"):
            if not (args.baseline_tree / part).exists():
                p.error(f"--baseline-tree {args.baseline_tree}: no {part}: a built checkout of this repository")
    return args


@contextmanager
def run_directory(path: Path, kind: str) -> Iterator[Path]:
    """Where the bundles and runc's state go, and cgpud's sockets. On a
    host that is /run, a tmpfs; these VMs have none there, and on their ext4
    every rewrite of a file that already has data (cgpud's config.json,
    runc's state.json) waits for ext4 to allocate the new data's blocks
    (auto_da_alloc), about 0.2 ms a file, and a file's creation or removal
    about 0.09 ms, which no host pays there."""
    path.mkdir()
    if kind == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=512m", "cgpu-bench-run", str(path)], check=True)
    try:
        yield path
    finally:
        if kind == "tmpfs":
            subprocess.run(["umount", "--lazy", str(path)], check=False)


def become_subreaper() -> None:
    """The container's init outlives `runc create`; as its subreaper this
    process waits for it directly, as containerd's shim does, instead of
    polling `runc state` (a runc exec of several ms per poll)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise BenchError(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


def reap_strays(cgpud: Daemon) -> None:
    """Reaps orphans other than the container init that ended up with us
    (a subreaper gets them all), but never cgpud: its exit is an error."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        if cgpud.proc is not None and info.si_pid == cgpud.proc.pid:
            raise BenchError(f"cgpud exited during the run (status {info.si_status})")
        os.waitpid(info.si_pid, 0)


def wait_exact(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """The exit status the moment it is there: a pidfd becomes readable at
    the exit. subprocess's own wait(timeout) polls with sleeps doubling from
    0.5 ms to 50 ms, which rounds a 33 ms command up to 63.5 ms."""
    fd = os.pidfd_open(proc.pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        proc.kill()
        proc.wait()
        raise subprocess.TimeoutExpired(proc.args, timeout)
    return proc.wait()


def runtime(v: Variant, runc_root: Path, *args: str, log: Path) -> None:
    cmd = [v.argv0, "--root", str(runc_root), *args]
    with open(log, "ab") as out:
        try:
            proc = subprocess.Popen(cmd, env=v.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            returncode = wait_exact(proc, RUN_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BenchError(f"{v.label}: {shlex.join(cmd)}: {exc}") from exc
    if returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise BenchError(f"{v.label}: {shlex.join(cmd)} exited {returncode}\n  " + "\n  ".join(tail))


def relay_prepare(relay: Path, cid: str, bundle: Path) -> str:
    """cgpud's hook-mode prepare, as the shim asks for `run`: the bundle then
    carries what cgpud's CDI spec gives a container (mounts, env, the
    createRuntime and poststop entries of cgpu-hook)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(RUN_TIMEOUT_S)
        conn.connect(str(relay))
        conn.sendall(f"prepare {cid}\n{bundle}".encode())
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    text = answer.decode(errors="replace").strip()
    if not text.startswith("ok instance "):
        raise BenchError(f"cgpud's prepare of {bundle} answered {text!r}")
    return text.removeprefix("ok instance ")


def relay_release(relay: Path, instance: str, cid: str, bundle: Path) -> None:
    """What the poststop hook would have asked."""
    state = json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "stopped", "bundle": str(bundle)})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(RUN_TIMEOUT_S)
        conn.connect(str(relay))
        conn.sendall(f"release {instance}\n{state}".encode())
        conn.shutdown(socket.SHUT_WR)
        answer = conn.recv(4096).decode(errors="replace").strip()
    if not answer.startswith("ok released"):
        raise BenchError(f"cgpud's release of {instance} answered {answer!r}")


def start_once(
    v: Variant, runc_root: Path, cid: str, work: Path, cgpud: Daemon, settle_ms: float = 0.0
) -> tuple[float, list[float]]:
    """One create+start+exit+delete; returns wall ms, and the ms of each of
    PHASES (the pid file's read counts to `start`). The container's stdio
    goes to a file: runc create hands it to the container, which outlives
    the create, so a pipe would never reach EOF."""
    (v.bundle.path / "config.json").write_bytes(v.config)  # prepare rewrote it last time
    instance = None
    if v.hooks:
        instance = relay_prepare(cgpud.relay, cid, v.bundle.path)  # untimed: the device plugin's part
        spec = json.loads((v.bundle.path / "config.json").read_bytes())
        if "createRuntime" not in spec.get("hooks", {}):
            raise BenchError(f"{v.label}: cgpud's hook-mode prepare wrote no createRuntime hook")
        if v.key == HOOK_FLOOR:
            for entries in spec["hooks"].values():
                for hook in entries:
                    hook["path"], hook["args"] = TRUE, ["true"]
            (v.bundle.path / "config.json").write_text(json.dumps(spec))
        time.sleep(settle_ms / 1e3)
    log = work / f"{v.key}.log"
    log.write_bytes(b"")
    pid_file = work / f"{v.key}.pid"
    pid_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    marks = []
    try:
        runtime(v, runc_root, "create", "--bundle", str(v.bundle.path), "--pid-file", str(pid_file), cid, log=log)
        marks.append(time.perf_counter())
        pid = int(pid_file.read_text())
        runtime(v, runc_root, "start", cid, log=log)
        marks.append(time.perf_counter())
        _, status = os.waitpid(pid, 0)  # blocking: no polling
        marks.append(time.perf_counter())
        runtime(v, runc_root, "delete", cid, log=log)
        marks.append(time.perf_counter())
    except BaseException:
        # Leave no container behind (through the same runtime, so a GPU
        # container's poststop hook still releases its instance).
        subprocess.run(
            [v.argv0, "--root", str(runc_root), "delete", "--force", cid],
            env=v.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        raise
    ms = (marks[-1] - t0) * 1e3
    phases = [(b - a) * 1e3 for a, b in zip([t0, *marks], marks)]
    if v.key == HOOK_FLOOR and instance is not None:  # no cgpu-hook bound it, so no exit releases it: here, untimed
        relay_release(cgpud.relay, instance, cid, v.bundle.path)
    if os.waitstatus_to_exitcode(status) != 0:
        raise BenchError(f"{v.label}: container {cid} (`true`) exited with status {status:#x}")
    config = (v.bundle.path / "config.json").read_bytes()
    if not v.gpu and config != v.config:
        raise BenchError(f"{v.label}: config.json was rewritten for a container that asked for nothing")
    if v.key == FLOOR and config != v.config:
        raise BenchError(f"{v.label}: config.json changed, but nothing should have prepared it")
    if v.key != FLOOR and v.shim and v.gpu and (config == v.config or b"cgpu-hook" in config):
        raise BenchError(f"{v.label}: the shim's prepare should rewrite config.json without hooks")
    reap_strays(cgpud)
    return ms, phases


def start_daemon(cgpud: Daemon) -> None:
    try:
        cgpud.start()  # its log goes to a file (Daemon.log)
    except AssertionError as exc:
        if cgpud.proc is not None:
            cgpud.proc.kill()
            cgpud.proc.wait()
        raise BenchError(f"cgpud did not start: {exc}") from exc


def instances(cgpud: Daemon, *extra: str) -> list[dict]:
    out = cgpud.cgpuctl("list", *extra, "--output", "json")
    if out.returncode != 0:
        raise BenchError(f"cgpuctl list {' '.join(extra)} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def median_ci(values: list[float]) -> tuple[float, float]:
    """Distribution-free ~95% interval of a median: order statistics at
    n/2 -+ 0.98 sqrt(n) (the normal approximation of the sign test)."""
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * n**0.5
    lo = max(0, int(n / 2 - half))
    hi = min(n - 1, int(n / 2 + half + 0.999))
    return ordered[lo], ordered[hi]


@dataclass(frozen=True)
class Paired:
    """The per-round differences of two variants (to - from): their median and its ~95% interval."""

    median: float
    lo: float
    hi: float

    def text(self, unit: str = "") -> str:
        return f"{self.median:+.2f}{unit} [{self.lo:+.2f}, {self.hi:+.2f}]"


def paired(before: list[float], after: list[float]) -> Paired:
    diffs = [y - x for x, y in zip(before, after)]
    lo, hi = median_ci(diffs)
    return Paired(statistics.median(diffs), lo, hi)


def difference(x: Variant, y: Variant) -> str:
    """y against x, at the median and paired."""
    return f"{y.median() - x.median():+.2f} ms at the median; paired {paired(x.ms, y.ms).text(' ms')}"


def report(variants: dict[str, Variant], args: argparse.Namespace) -> None:
    head = ("variant", "median ms", "p90 ms", "IQR ms")
    rows = [(v.label, f"{v.median():.2f}", f"{v.p90():.2f}", f"{v.spread():.2f}") for v in variants.values()]
    print()
    print(
        f"Wall ms per create+start+wait+delete of `true`; {args.rounds} interleaved rounds after "
        f"{args.warmup} warm-up round(s)"
    )
    print_table(head, rows)

    print("\nEach step's median ms, and what it added over plain runc with the GPU bundle (paired, ~95% interval):")
    base = variants["runc-gpu"]
    phase_rows = []
    for v in variants.values():
        cells = []
        for name in PHASES:
            cell = f"{statistics.median(v.phases[name]):.2f}"
            if v.gpu and v is not base:
                cell += f" ({paired(base.phases[name], v.phases[name]).text()})"
            cells.append(cell)
        phase_rows.append((v.label, *cells))
    print_table(("variant", *PHASES), phase_rows)

    print("\nEach round (ms):")
    for v in variants.values():
        print(f"  {v.key:<10} {' '.join(f'{x:.1f}' for x in v.ms)}")

    print(
        "\nTargets (added at the median = shim median - plain runc median, same bundle; paired = the "
        "median of the per-round differences, with its ~95% interval):"
    )
    for text, base, measured, limit, p90_limit in TARGETS:
        if base not in variants or measured not in variants:
            continue
        b, m = variants[base], variants[measured]
        added = m.median() - b.median()
        verdict = "PASS" if added <= limit else "FAIL"
        diff = paired(b.ms, m.ms)
        noise = ""
        if diff.lo <= limit < diff.hi:
            noise = "  [not decided: the interval straddles the target; more --rounds or a quieter machine]"
        print(
            f"  {verdict:<5} {text}: {added:+.2f} ms at the median, ratio {m.median() / b.median():.3f}x "
            f"(target <= {limit:g} ms); paired {diff.text(' ms')}{noise}"
        )
        if p90_limit is not None:
            added90 = m.p90() - b.p90()
            verdict = "PASS" if added90 <= p90_limit else "FAIL"
            print(
                f"  {verdict:<5} {text}: {added90:+.2f} ms at p90 ({m.p90():.2f} vs {b.p90():.2f} ms), "
                f"ratio {m.p90() / b.p90():.3f}x (target <= {p90_limit:g} ms)"
            )
    pairs = [(text, x, y) for text, x, y in AGAINST_BASELINE if x in variants and y in variants]
    if pairs:
        print(
            "\nThis tree against --baseline-tree (paired medians of this tree minus that one, ~95% intervals; "
            "and each step's):"
        )
    for text, x_key, y_key in pairs:
        x, y = variants[x_key], variants[y_key]
        steps = [f"{name} {paired(x.phases[name], y.phases[name]).text()}" for name in PHASES]
        print(f"  {text}: {difference(x, y)}; {', '.join(steps)}")
    parts = [(text, x, y) for text, x, y in PARTS if x in variants and y in variants]
    if parts:
        print("\nWhere the added time goes (information; paired medians with their ~95% intervals):")
    for text, x_key, y_key in parts:
        print(f"  {text}: {difference(variants[x_key], variants[y_key])}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        require_tools()
    except MissingTool as exc:
        raise BenchError(str(exc)) from exc
    shim = native_path("bin/cgpu-runtime")
    for part in (shim, native_path("bin/cgpu-hook"), native_path("lib/libcgpu.so")):
        if not part.exists():
            raise BenchError(f"{part} is missing: run `pip install -e .` in {ROOT}")
    runc = shutil.which("runc")
    assert runc  # require_tools checked
    become_subreaper()

    print("command:", shlex.join([sys.executable, *sys.argv]), f"(cwd {Path.cwd()})")
    with (
        tempfile.TemporaryDirectory(prefix="cgpu-bench-start-") as tmp,
        run_directory(Path(tmp) / "run", args.bundles_on) as run,
        contextlib.ExitStack() as sockets,
    ):
        work = Path(tmp)
        gpu = work / "gpu"
        gpu.mkdir()
        sim_env = dict(
            os.environ,
            LD_LIBRARY_PATH=str(native_dir() / "sim"),
            CGPU_SIM_CONFIG=str(write_sim_config(gpu / "sim.conf", gpus=1)),
            CGPU_SIM_STATE=str(gpu / "sim.state"),
        )
        host = Host(build_rootfs(run / "rootfs"), gpu, sim_env, run / "runc", default_spec())
        daemon_dir = work / "cgpud"
        daemon_dir.mkdir()
        # Its sockets' directory (make_daemon's run/): /run/cgpud on a host, a tmpfs.
        sockets.enter_context(run_directory(daemon_dir / "run", args.bundles_on))
        cgpud = make_daemon(daemon_dir, sim_env, "--sweep-interval", DAEMON_SWEEP_INTERVAL)
        start_daemon(cgpud)
        baseline = None
        if args.baseline_tree is not None:
            # The same cgpud entry point, importing the other checkout first.
            (work / "cgpud-baseline").mkdir()
            sockets.enter_context(run_directory(work / "cgpud-baseline" / "run", args.bundles_on))
            baseline = make_daemon(
                work / "cgpud-baseline",
                dict(sim_env, PYTHONPATH=str(args.baseline_tree)),
                "--sweep-interval",
                DAEMON_SWEEP_INTERVAL,
            )
            start_daemon(baseline)
        (run / "instant-relay").mkdir(mode=0o700)
        instant = InstantRelay(run / "instant-relay" / "relay.sock")
        try:
            variants: dict[str, Variant] = {}
            for key, label, via_shim, wants_gpu, hooks in VARIANTS:
                if args.only is not None and key not in args.only:
                    continue
                # One bundle per variant, so a GPU start never sees another's
                # leftovers; the two of a kind have the same config.json bytes.
                env = (GPU_REQUEST,) if wants_gpu else ()
                bundle = host.bundle(run / "bundles" / key, ["true"], env, gpu_device=wants_gpu)
                relay = run / "instant-relay" / "relay.sock" if key == FLOOR else cgpud.relay
                variants[key] = Variant(
                    key,
                    label,
                    via_shim,
                    wants_gpu,
                    hooks,
                    bundle,
                    (bundle.path / "config.json").read_bytes(),
                    runtime_env(relay, dict(os.environ)) if via_shim else dict(os.environ),
                    str(shim) if via_shim else runc,
                )
            if baseline is not None:
                for key, label, via_shim, hooks in BASELINE_VARIANTS:
                    if args.only is not None and key not in args.only:
                        continue
                    bundle = host.bundle(run / "bundles" / key, ["true"], (GPU_REQUEST,), gpu_device=True)
                    variants[key] = Variant(
                        key,
                        label,
                        via_shim,
                        True,
                        hooks,
                        bundle,
                        (bundle.path / "config.json").read_bytes(),
                        runtime_env(baseline.relay, dict(os.environ)) if via_shim else dict(os.environ),
                        str(args.baseline_tree / "cgpud/_native/bin/cgpu-runtime") if via_shim else runc,
                        daemon=baseline,
                    )
            version = subprocess.run([runc, "--version"], capture_output=True, text=True, check=False).stdout
            print(
                f"runtime: runc {version.split()[2] if len(version.split()) > 2 else '?'} ({runc}); "
                f"shim {shim} with CGPU_REAL_RUNTIME={runc} CGPU_RELAY_SOCKET={cgpud.relay}"
            )
            print(
                f"timed:   RUNTIME --root {host.runc_root} create --bundle B --pid-file F ID; "
                f"RUNTIME --root {host.runc_root} start ID; waitpid(init); RUNTIME --root {host.runc_root} delete ID"
            )
            print(
                f"bundles: on {args.bundles_on} ({run}), with runc's state; "
                f"busybox `true`, non-GPU: no toolkit mounts; GPU: the simulated device directory "
                f"bind-mounted (the toolkit's part) and {GPU_REQUEST}; hooks: cgpud's hook-mode prepare "
                f"over the relay socket before each start, untimed"
                + (f", then {args.settle_ms:g} ms untimed before the create" if args.settle_ms else "")
            )
            print(
                f"cgpud:   {Path(sys.executable).parent / 'cgpud'} on a simulated 1 x 16 GiB GPU, "
                f"--sweep-interval {DAEMON_SWEEP_INTERVAL}, "
                f"state in {cgpud.state}"
            )
            print(
                f"host:    {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
                f"variants in a fresh order each round (--seed {args.seed})",
                flush=True,
            )

            order = list(variants.values())
            rng = random.Random(args.seed)
            for r in range(-args.warmup, args.rounds):
                # A fresh order every round: a start runs measurably slower
                # right after some others (a heavier one before it leaves
                # the caches and cgpud busy), so each variant must follow
                # every other as often, not always the same one.
                for v in rng.sample(order, len(order)):
                    ms, phases = start_once(
                        v,
                        host.runc_root,
                        f"bench-{os.getpid()}-{v.key}-{r + args.warmup}",
                        work,
                        v.daemon or cgpud,
                        args.settle_ms,
                    )
                    if r >= 0:
                        v.ms.append(ms)
                        for name, phase_ms in zip(PHASES, phases):
                            v.phases[name].append(phase_ms)
                if r >= 0 and (r + 1) % 25 == 0:
                    print(
                        f"  round {r + 1}/{args.rounds}: "
                        + ", ".join(f"{v.key} {v.median():.1f}" for v in order)
                        + " ms (medians so far)",
                        flush=True,
                    )
            print(f"host:    load average {os.getloadavg()[0]:.2f} at end")

            left = instances(cgpud)
            if left:
                raise BenchError(
                    f"cgpud still has {len(left)} active instance(s) after the run: "
                    + ", ".join(f"{i.get('id')} ({i.get('state')})" for i in left)
                )
            # The GPU starts through this cgpud: each releases one instance.
            gpu_starts = len(variants.keys() & {"shim-gpu", "hook-gpu", HOOK_FLOOR}) * (args.rounds + args.warmup)
            released = [i for i in instances(cgpud, "--all") if i.get("state") == "released"]
            print(
                f"cgpud:   no active instance left; {len(released)} released "
                f"(expected {gpu_starts}, one per GPU start through the shim or the hooks, real or doing nothing)"
            )
            if len(released) != gpu_starts:
                raise BenchError(f"expected {gpu_starts} released instances, cgpud lists {len(released)}")
            starts = args.rounds + args.warmup
            floor_starts = starts if FLOOR in variants else 0
            if instant.asked != {"prepare": floor_starts, "bind": floor_starts, "release": 0}:
                raise BenchError(
                    f"the relay doing nothing was asked {instant.asked}, expected {floor_starts} "
                    f"prepare and bind and no release: the shim did not take its GPU path"
                )
        finally:
            instant.close()
            if baseline is not None:
                baseline.stop()
            try:
                cgpud.stop()
            except AssertionError as exc:
                tail = cgpud.log.read_text(errors="replace").strip().splitlines()[-5:]
                raise BenchError(f"cgpud did not stop cleanly: {exc}\n  " + "\n  ".join(tail)) from exc
        report(variants, args)
    return 0


if __name__ == "__main__":
    exit_with("bench_container_start", main)
