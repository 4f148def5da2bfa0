"""Modes the GPU and driver may allow: MPS (cgpud's `mps` node mode sets
EXCLUSIVE_PROCESS and runs one MPS control daemon per GPU; a tenant gets its
memory limit and thread percentage as an MPS client) and MIG (a 1-slice GPU
instance made through NVML, shared by cgpud's `mig_share`). Each records the
state it found and puts it back in a `finally`, then checks it is back."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pynvml as n

from bench.gpu_check import nvml
from bench.gpu_check.model import CheckError, CheckResult, Skip
from bench.gpu_check.rig import LOG, Rig
from bench.gpu_check.runner import Runner, verdict

GROUP = "modes"
GIB = 1 << 30
EXCLUSIVE_PROCESS = 3


def _limit_holds(burn: dict[str, Any], limit: int) -> bool:
    alloc = burn["alloc"]
    return int(burn["mem_total_reported"]) == limit and limit - GIB // 4 < int(alloc["until_fail_bytes"]) <= limit


def mps(rig: Rig) -> CheckResult:
    if os.geteuid() != 0:
        raise Skip("MPS: needs root (cgpud sets the compute mode)")
    if shutil.which("nvidia-cuda-mps-control", path=rig.env.get("PATH")) is None:
        raise Skip("MPS: nvidia-cuda-mps-control is not on PATH")
    gpus = nvml.machine()["gpus"]
    if all(g["mig_mode"] == 1 for g in gpus):
        raise Skip("MPS: every GPU is in MIG mode (MPS runs on whole GPUs here)")
    found = [g["compute_mode"] for g in gpus]
    limit = rig.options.mem_gib * GIB
    during: list[int] = []
    try:
        with rig.cgpud("mps", "--mode", "mps") as d:
            during = [nvml.compute_mode(i) for i in range(len(found))]
            burn = rig.burn(
                ["--alloc-until-fail", "256MiB", "--duration", str(rig.seconds(1.0, 3.0)), "--kernel-ns", "1000000"],
                90,
                "an MPS client under cgpuctl run",
                prefix=d.run_argv(f"{rig.options.mem_gib}GiB", core=30),
            )
    finally:
        after = [nvml.compute_mode(i) for i in range(len(found))]
        for i, (was, now) in enumerate(zip(found, after)):
            if was != now:
                LOG.warning("compute mode not restored by cgpud: setting it back", gpu=i, found=was, now=now)
                nvml.set_compute_mode(i, was)
    ran = int(burn["launches"]) > 0 and not burn["errors"]
    ok = _limit_holds(burn, limit) and ran and all(m == EXCLUSIVE_PROCESS for m in during) and after == found
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"sees {int(burn['mem_total_reported']) >> 20} MiB, {burn['launches']} kernels; mode restored: "
        f"{after == found}",
        expected="limit held, kernels run, EXCLUSIVE_PROCESS while cgpud runs, mode as found after",
        detail="" if ok else f"compute modes found {found}, during {during}, after {after}; errors {burn['errors']}",
        values={"found": found, "during": during, "after": after, "burn": burn},
    )


@contextmanager
def mig_device(index: int) -> Iterator[str]:
    """A MIG device on GPU `index`: one already there, or a 1-slice GPU
    instance with its compute instance made for the block (and MIG mode
    enabled for it); everything made is destroyed and the MIG mode found
    is set back when the block ends."""
    made: list[Any] = []
    with nvml.session():
        h = n.nvmlDeviceGetHandleByIndex(index)
        mode = nvml.mig_mode_of(h)
        if mode is None:
            raise Skip("MIG: the GPU does not support MIG")
        if mode == 0 and n.nvmlDeviceGetComputeRunningProcesses(h):
            raise Skip("MIG: other processes use the GPU; enabling MIG needs it idle")
        try:
            if mode == 0:
                n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE)
                if nvml.mig_mode_of(h) != 1:
                    raise Skip("MIG: enabling MIG is pending a GPU reset on this machine")
            try:
                existing = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
                yield n.nvmlDeviceGetUUID(existing)
                return
            except n.NVMLError_NotFound:
                pass
            profile = n.nvmlDeviceGetGpuInstanceProfileInfo(h, n.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
            gi = n.nvmlDeviceCreateGpuInstance(h, profile.id)
            made.append(gi)
            cp = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            made.append(n.nvmlGpuInstanceCreateComputeInstance(gi, cp.id))
            uuid = n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0))
            yield uuid.decode() if isinstance(uuid, bytes) else uuid
        except n.NVMLError as e:
            raise CheckError(f"MIG set-up through NVML: {e}") from e
        finally:
            errors = []
            for obj, destroy in zip(
                reversed(made), (n.nvmlComputeInstanceDestroy, n.nvmlGpuInstanceDestroy)[-len(made) :]
            ):
                try:
                    destroy(obj)
                except n.NVMLError as e:
                    errors.append(f"{destroy.__name__}: {e}")
            if mode == 0 and nvml.mig_mode_of(h) != 0:
                try:
                    n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_DISABLE)
                except n.NVMLError as e:
                    errors.append(f"disabling MIG: {e}")
            if errors:
                LOG.error("MIG not restored", errors=errors)


def mig(rig: Rig) -> CheckResult:
    if os.geteuid() != 0:
        raise Skip("MIG: needs root (MIG mode and instances)")
    gpus = nvml.machine()["gpus"]
    found = gpus[0]["mig_mode"]
    if found is None:
        raise Skip("MIG: the GPU does not support MIG")
    limit = rig.options.mem_gib * GIB
    with mig_device(0) as uuid:
        with rig.cgpud("mig", "--mode", "cgpu", "--mig-share") as d:
            # every other whole GPU taken, so the share can only land on the MIG device
            held = [
                d.cgpuctl(
                    "create", "--mem", f"{int(g['memory_total']) >> 30}GiB", "--name", f"hold-{g['index']}"
                ).stdout.strip()
                for g in gpus[1:]
                if g["mig_mode"] != 1
            ]
            try:
                burn = rig.burn(
                    ["--alloc-until-fail", "256MiB"],
                    60,
                    "cgpu-burn on the MIG device under cgpuctl run",
                    prefix=d.run_argv(f"{rig.options.mem_gib}GiB"),
                )
            finally:
                for iid in held:
                    d.cgpuctl("release", iid, check=False)
    after = nvml.machine()["gpus"][0]["mig_mode"]
    # the driver API has no MIG- prefix: cgpu-burn prints every UUID's bytes as GPU-...
    on_mig = str(burn["uuid"])[4:] == uuid[4:]
    ok = on_mig and _limit_holds(burn, limit) and after == found
    return CheckResult(
        "",
        GROUP,
        verdict(ok),
        figure=f"{burn['name']}: sees {int(burn['mem_total_reported']) >> 20} MiB; MIG mode {found} -> {after}",
        expected=f"the share on {uuid} holds {limit >> 20} MiB; MIG mode as found after",
        detail="" if ok else f"ran on {burn['uuid']}, found MIG mode {found}, after {after}",
        values={"mig_device": uuid, "found_mode": found, "after_mode": after, "burn": burn},
    )


def run(rig: Rig, runner: Runner) -> None:
    runner.check("modes.mps", GROUP, partial(mps, rig))
    runner.check("modes.mig", GROUP, partial(mig, rig))
