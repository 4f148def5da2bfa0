"""Per-stage times of GPU container starts, from the kernel's own process
events, while bench_container_start runs (with --baseline-tree, both builds).

Records `sched_process_fork`, `sched_process_exec` and `sched_process_exit`
on every CPU with `perf record` for SECONDS (or reads a recording), and
times, per build:
  - the front: `cgpu-runtime`'s exec to its exec of `cgpu-runtime-gpu`;
  - the shim proper: its exec to runc's exec (its start, the FIFO, the
    prepare sent; negative once the front starts runc itself), the front's
    exec to runc's exec; runc's `create` (exec to exit); runc's exit to the
    shim's exit (the bind's round trip and the exit);
  - the hook: `cgpu-hook`'s exec to its exit (its start, the relay round trip,
    cgpud's bind), and runc's `create` that ran it; a `true` hook beside it
    (bench_container_start's hook-floor).
A build is told by the path it was exec'd from: the shim from the tree, the
hook from the cgpud state directory it was copied into (`cgpud/` this tree,
`cgpud-baseline/` the baseline's). The shim rows of this tree also hold the
`shim-floor` starts (a relay doing nothing; same binaries) unless the run was
made with --only shim-gpu,... Tracepoints cost next to nothing beside
strace, so the run being traced is the one measured.

    .venv/bin/python -m bench.bench_container_start --rounds 600 --baseline-tree /tmp/base &
    sleep 20; .venv/bin/python -m bench.trace_start_stages --seconds 240 --base-tree /tmp/base
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

EVENTS = ("sched:sched_process_fork", "sched:sched_process_exec", "sched:sched_process_exit")
LINE = re.compile(r"\s*(.*?)\s+(\d+)/(\d+)\s+([\d.]+):\s+sched:(\w+):\s+(.*)")
HERE = Path(__file__).resolve().parents[1]


def record(out: Path, seconds: float) -> None:
    events = [arg for e in EVENTS for arg in ("-e", e)]
    subprocess.run(["perf", "record", "-q", "-o", str(out), *events, "-a", "--", "sleep", str(seconds)], check=True)


def stages(data: Path, base_tree: str) -> dict[tuple[str, str], list[float]]:
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "comm,pid,tid,time,event,trace"],
        capture_output=True,
        encoding="utf-8",
        errors="replace",  # a process may name itself in any bytes
        check=True,
    ).stdout
    parent: dict[int, int] = {}
    execs: dict[int, list[tuple[float, str]]] = defaultdict(list)
    exited: dict[int, float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        pid, t, kind, rest = int(m.group(2)), float(m.group(4)) * 1e3, m.group(5), m.group(6)
        if kind == "sched_process_fork":
            child = re.search(r"child_pid=(\d+)", rest)
            if child:
                parent.setdefault(int(child.group(1)), pid)
        elif kind == "sched_process_exec":
            f = re.search(r"filename=(\S+)", rest)
            if f:
                execs[pid].append((t, f.group(1)))
        elif kind == "sched_process_exit" and "group_dead=true" in rest:
            exited[pid] = t

    def build(path: str) -> str | None:
        if "/cgpud-baseline/state/runtime/" in path or path.startswith(base_tree):
            return "baseline"
        if "/cgpud/state/runtime/" in path or path.startswith(str(HERE)):
            return "this tree"
        return None

    def runc_of(pid: int) -> int | None:
        r = parent.get(pid)
        return r if r in execs and execs[r][0][1].endswith("/runc") and r in exited else None

    children: dict[int, list[int]] = defaultdict(list)
    for c, p in parent.items():
        children[p].append(c)
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for pid, xs in execs.items():
        for i, (t, f) in enumerate(xs):
            b = build(f)
            if b and f.endswith("/cgpu-runtime") and i + 1 < len(xs) and xs[i + 1][1].endswith("/cgpu-runtime-gpu"):
                t1 = xs[i + 1][0]
                out[(b, "front: exec to the shim proper's exec")].append(t1 - t)
                runcs = sorted(
                    (execs[c][0][0], c) for c in children[pid] if execs.get(c, [(0, "")])[0][1].endswith("/runc")
                )
                if runcs and pid in exited and runcs[0][1] in exited:
                    t2, c = runcs[0]
                    # Since 2026-11-29 (p39-start2) the front starts runc before it
                    # execs the shim proper: this is then negative, and the row
                    # both builds share is the front's exec to runc's.
                    out[(b, "shim: its exec to runc's exec")].append(t2 - t1)
                    out[(b, "shim: the front's exec to runc's exec")].append(t2 - t)
                    out[(b, "shim: runc create, exec to exit")].append(exited[c] - t2)
                    out[(b, "shim: runc's exit to the shim's exit (bind)")].append(exited[pid] - exited[c])
                    out[(b, "shim: the front's exec to the shim's exit")].append(exited[pid] - t)
            hook = b if f.endswith("/cgpu-hook") else "true hook" if f == "/usr/bin/true" else None
            r = runc_of(pid)
            if hook and r is not None and pid in exited:
                out[(hook, "hook: its exec to its exit")].append(exited[pid] - t)
                out[(hook, "hook: runc create that ran it, exec to exit")].append(exited[r] - execs[r][0][0])
    return out


def interval(a: list[float], b: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A bootstrap ~95% interval of median(b) - median(a)."""
    rng = random.Random(1)
    d = sorted(
        statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a))) for _ in range(rounds)
    )
    return d[int(rounds * 0.025)], d[int(rounds * 0.975)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=240.0, help="how long to record")
    p.add_argument("--data", type=Path, help="read this perf recording instead of making one")
    p.add_argument("--base-tree", default="/tmp/base", help="the --baseline-tree the benchmark runs with")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp) / "stages.data"
        if args.data is None:
            record(data, args.seconds)
        got = stages(data, str(Path(args.base_tree).resolve()))
    print(f"{'stage (median ms, n)':46s} {'baseline':>16s} {'this tree':>16s} {'this - baseline [~95%]':>24s}")
    for stage in sorted({s for _, s in got}):
        a, b = got.get(("baseline", stage), []), got.get(("this tree", stage), [])
        t = got.get(("true hook", stage), [])
        cells = [f"{statistics.median(v):7.3f} ({len(v)})" if v else "" for v in (a, b)]
        diff = ""
        if a and b:
            lo, hi = interval(a, b)
            diff = f"{statistics.median(b) - statistics.median(a):+.3f} [{lo:+.3f}, {hi:+.3f}]"
        line = f"{stage:46s} {cells[0]:>16s} {cells[1]:>16s} {diff:>24s}"
        if t:
            line += f"   `true` hook: {statistics.median(t):.3f} ({len(t)})"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
