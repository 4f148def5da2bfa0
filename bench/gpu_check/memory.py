"""Memory limit: under `cgpuctl run --mem N`, what a tenant sees and what it
can hold, through the driver API (cgpu-burn), the CUDA runtime (spin.cu),
the VMM calls (cgpu-burn --alloc-api vmm) and NVML (what nvidia-smi shows),
with what the GPU really held read from NVML outside the tenant."""

from __future__ import annotations

import sys
import threading

from bench.gpu_check import nvml
from bench.gpu_check.model import CheckError, CheckResult
from bench.gpu_check.rig import Cgpud, Rig, json_line, steps
from bench.gpu_check.runner import Runner, verdict

GIB = 1 << 30
MIB = 1 << 20
CHUNK = 256 * MIB
# What a CUDA context and the runtime's own allocations hold on a real GPU
# beside the tenant's allocations: NVML counts them, the limit does not.
CONTEXT_ALLOWANCE = 1 * GIB
GROUP = "memory"

# the instance's GPU by the UUID cgpuctl run gives the tenant (NVML ignores CUDA_VISIBLE_DEVICES)
NVML_VIEW = """
import json, os, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByUUID(os.environ["NVIDIA_VISIBLE_DEVICES"].split(",")[0].encode())
m = n.nvmlDeviceGetMemoryInfo(h)
print(json.dumps({"total": int(m.total), "free": int(m.free), "used": int(m.used)}))
"""


class PeakUse:
    """The most memory any GPU had in use above what it had at the start,
    sampled every 50 ms from NVML while the block runs (the tenant's GPU is
    whichever cgpud placed it on)."""

    def __init__(self) -> None:
        self.base = nvml.memory_used_all()
        self.peak = list(self.base)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = [max(p, u) for p, u in zip(self.peak, nvml.memory_used_all())]

    def __enter__(self) -> PeakUse:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    @property
    def held(self) -> int:
        return max((p - b for p, b in zip(self.peak, self.base)), default=0)


def _mib(b: int) -> str:
    return f"{b / MIB:.0f} MiB"


def driver_api(rig: Rig, d: Cgpud, api: str) -> CheckResult:
    limit = rig.options.mem_gib * GIB
    hold = rig.seconds(1.0, 3.0)
    with PeakUse() as use:
        burn = rig.burn(
            ["--alloc-api", api, "--alloc-until-fail", str(CHUNK), "--hold", str(hold)],
            60,
            f"cgpu-burn --alloc-api {api} under cgpuctl run",
            prefix=d.run_argv(f"{rig.options.mem_gib}GiB"),
        )
    alloc = burn["alloc"]
    got, seen = int(alloc["until_fail_bytes"]), int(burn["mem_total_reported"])
    ok = (
        seen == limit
        and limit - CHUNK < got <= limit
        and alloc["until_fail_result"] == "CUDA_ERROR_OUT_OF_MEMORY"
        and use.held <= limit + CONTEXT_ALLOWANCE
    )
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"sees {_mib(seen)}, got {_mib(got)}, GPU held {_mib(use.held)}",
        expected=f"sees {_mib(limit)}, gets > {_mib(limit - CHUNK)} and <= it, then OUT_OF_MEMORY",
        detail="" if ok else f"refused with {alloc['until_fail_result']}",
        values={
            "limit": limit,
            "seen_total": seen,
            "allocated": got,
            "refusal": alloc["until_fail_result"],
            "gpu_held": use.held,
            "api": api,
        },
    )


def cudart(rig: Rig, d: Cgpud) -> CheckResult:
    limit = rig.options.mem_gib * GIB
    hold = f"burn={rig.seconds(0.5, 2.0)}"  # kernels while the filled memory is held, for NVML to see it
    with PeakUse() as use:
        done = rig.run(
            d.run_argv(f"{rig.options.mem_gib}GiB", str(rig.tools.spin), "meminfo", "fill", hold, "meminfo"),
            120,
            "spin (CUDA runtime) meminfo fill under cgpuctl run",
        )
    got = steps(done.stdout)
    try:
        seen = int(got["meminfo"][2])
        filled = int(got["fill"][1])
        refusal = got["fill"][0]
    except (KeyError, IndexError, ValueError) as e:
        raise CheckError(f"spin printed no meminfo/fill report: {done.stdout[-300:]!r}") from e
    # cudart keeps some memory of its own; what it lets the program have lies
    # within a quarter GiB of the limit
    ok = seen == limit and limit - GIB // 4 <= filled <= limit and refusal == "cudaErrorMemoryAllocation"
    ok = ok and use.held <= limit + CONTEXT_ALLOWANCE
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"sees {_mib(seen)}, got {_mib(filled)}, GPU held {_mib(use.held)}",
        expected=f"sees {_mib(limit)}, gets {_mib(limit - GIB // 4)}..{_mib(limit)}",
        detail="" if ok else f"fill ended with {refusal}",
        values={"limit": limit, "seen_total": seen, "allocated": filled, "refusal": refusal, "gpu_held": use.held},
    )


def nvml_view(rig: Rig, d: Cgpud) -> CheckResult:
    limit = rig.options.mem_gib * GIB
    prefix = d.run_argv(f"{rig.options.mem_gib}GiB")
    view = json_line(rig.run([*prefix, sys.executable, "-c", NVML_VIEW], 60, "NVML inside cgpuctl run").stdout, "NVML")
    values: dict[str, object] = {"limit": limit, "nvml_total": view["total"]}
    ok = int(view["total"]) == limit
    figure = f"NVML total {_mib(int(view['total']))}"
    smi = rig.machine.get("nvidia_smi")
    if smi:
        out = rig.run(
            [
                *prefix,
                "sh",
                "-c",
                f'exec "{smi}" --query-gpu=memory.total --format=csv,noheader,nounits '
                '--id="${NVIDIA_VISIBLE_DEVICES%%,*}"',
            ],
            60,
            "nvidia-smi inside cgpuctl run",
        ).stdout.strip()
        try:
            smi_mib = int(out.splitlines()[0].strip())
        except (ValueError, IndexError) as e:
            raise CheckError(f"nvidia-smi printed {out!r}, not a memory size in MiB") from e
        values["nvidia_smi_total_mib"] = smi_mib
        ok = ok and smi_mib == limit // MIB
        figure += f", nvidia-smi {smi_mib} MiB"
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=figure,
        expected=f"{_mib(limit)}",
        detail="" if smi else "nvidia-smi not on PATH: NVML read directly (what nvidia-smi shows)",
        values=values,
    )


def run(rig: Rig, runner: Runner) -> None:
    names = ("memory.driver", "memory.cudart", "memory.vmm", "memory.nvml")
    if not any(runner.wanted(n) for n in names):
        return
    try:
        with rig.cgpud("memory", "--mode", "cgpu") as d:
            runner.check("memory.driver", GROUP, lambda: driver_api(rig, d, "alloc"))
            runner.check("memory.cudart", GROUP, lambda: cudart(rig, d))
            runner.check("memory.vmm", GROUP, lambda: driver_api(rig, d, "vmm"))
            runner.check("memory.nvml", GROUP, lambda: nvml_view(rig, d))
    except CheckError as e:
        runner.fail_rest(names, GROUP, str(e))
