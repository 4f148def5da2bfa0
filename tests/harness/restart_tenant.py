"""A tenant that keeps working while cgpud restarts, for
tests/integration/test_restart_under_load.py: run under libcgpu.so (the
instance's environment) as `python -m tests.harness.restart_tenant MODE ...`, it
counts what a tenant would notice and prints one JSON object when it gets
SIGTERM.

- `mem`: allocates its whole limit in four pieces, then asks for more than
  is left (which must fail with CUDA_ERROR_OUT_OF_MEMORY), frees, again;
  one short kernel a round. Counts allocations refused within the limit
  and allocations granted past it.
- `compute`: launches spin kernels round-robin over `--streams` streams,
  synchronising every `--sync-every` launches.

Both time every launch and allocation call and the gap between one launch's
return and the next's: a gate that never opens or a wait on cgpud shows
there. Only the driver ABI is used (tests/harness/cudapy.py)."""

from __future__ import annotations

import argparse
import ctypes as C
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass

from tests.harness.cudapy import CudaError, Driver

MIB = 1 << 20


@dataclass
class Counts:
    launches: int = 0
    launch_errors: int = 0
    worst_launch_gap_ns: int = 0  # between two launches' returns
    worst_launch_gap_at_ns: int = 0  # CLOCK_MONOTONIC when that gap ended
    worst_launch_call_ns: int = 0
    rounds: int = 0  # mem: allocate-to-the-limit rounds
    allocs: int = 0
    alloc_errors: int = 0  # refused within the limit
    past_limit_granted: int = 0  # granted past the limit: a limit lost
    worst_alloc_call_ns: int = 0
    total: int = 0  # what cuMemGetInfo says the GPU holds
    errors: list[str] | None = None


class Tenant:
    def __init__(self, kernel_ns: int, streams: int) -> None:
        self.cuda = Driver()
        self.cuda.init_device(0)
        self.fn = self.cuda.spin_function()
        self.kernel_ns = kernel_ns
        self.streams = [C.c_void_p() for _ in range(streams)]
        for s in self.streams:
            self.cuda.call("cuStreamCreate", C.byref(s), 0)
        self.c = Counts(errors=[])
        self.last_return = 0
        self.stop = False

    def _error(self, what: str) -> None:
        assert self.c.errors is not None
        if len(self.c.errors) < 10:
            self.c.errors.append(what)

    def launch(self, i: int) -> None:
        t0 = time.monotonic_ns()
        try:
            self.cuda.launch_spin(self.fn, self.kernel_ns, self.streams[i % len(self.streams)])
        except CudaError as e:
            self.c.launch_errors += 1
            self._error(str(e))
        t1 = time.monotonic_ns()
        self.c.launches += 1
        self.c.worst_launch_call_ns = max(self.c.worst_launch_call_ns, t1 - t0)
        if self.last_return and t1 - self.last_return > self.c.worst_launch_gap_ns:
            self.c.worst_launch_gap_ns, self.c.worst_launch_gap_at_ns = t1 - self.last_return, t1
        self.last_return = t1

    def sync(self) -> None:
        for s in self.streams:
            try:
                self.cuda.call("cuStreamSynchronize", s)
            except CudaError as e:
                self.c.launch_errors += 1
                self._error(str(e))

    def alloc(self, size: int) -> int | None:
        ptr = C.c_uint64()
        t0 = time.monotonic_ns()
        rc = self.cuda.rc("cuMemAlloc_v2", C.byref(ptr), C.c_size_t(size))
        self.c.worst_alloc_call_ns = max(self.c.worst_alloc_call_ns, time.monotonic_ns() - t0)
        self.c.allocs += 1
        return ptr.value if rc == "CUDA_SUCCESS" else None

    def run_compute(self, sync_every: int) -> None:
        i = 0
        while not self.stop:
            self.launch(i)
            i += 1
            if i % sync_every == 0:
                self.sync()

    def run_mem(self, pause_s: float) -> None:
        free, self.c.total = self.cuda.mem_info()
        piece = (free // 4) // (2 * MIB) * (2 * MIB)
        while not self.stop:
            held = []
            for _ in range(4):
                p = self.alloc(piece)
                if p is None:
                    self.c.alloc_errors += 1
                    self._error(f"a {piece} B allocation within the limit was refused")
                else:
                    held.append(p)
            left, _ = self.cuda.mem_info()
            past = self.alloc(left + 2 * MIB)
            if past is not None:
                self.c.past_limit_granted += 1
                self._error(f"{left + 2 * MIB} B granted with {left} B left")
                held.append(past)
            for p in held:
                self.cuda.call("cuMemFree_v2", C.c_uint64(p))
            self.launch(0)
            self.sync()
            self.c.rounds += 1
            time.sleep(pause_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("mem", "compute"))
    p.add_argument("--kernel-ns", type=int, default=1_000_000)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--pause", type=float, default=0.02)
    args = p.parse_args(argv)
    t = Tenant(args.kernel_ns, args.streams)

    def on_term(_s: int, _f: object) -> None:
        t.stop = True

    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    if args.mode == "mem":
        t.run_mem(args.pause)
    else:
        t.run_compute(args.sync_every)
    t.sync()
    print(json.dumps(asdict(t.c)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
