"""Device memory is charged for as long as it physically exists: VMM memory
until its handle is released and its last mapping unmapped (in either
order), imported memory to the importer, exported memory to the exporter,
graph memory nodes refused, context heap and stack growth, and the 32-bit
entry points cuGetProcAddress hands a runtime built for CUDA 3.0. Each case
is a tenant program in C (tests/intercept/programs/memory_attack.c)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.harness.simrun import run_py, sim_stat
from tests.harness.grants import GIB
from tests.harness.memory_attack import Phased, build_attacker, check_vmm_sequence

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def attacker(tmp_path: Path) -> Path:
    return build_attacker(tmp_path)


def run_once(attacker: Path, env: dict[str, str], mode: str) -> list[dict]:
    proc = subprocess.run(
        [str(attacker), mode], env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def gpu_used(native: Path, env: dict[str, str]) -> int:
    return int(sim_stat(native, env)["gpus"][0]["used"])


def test_vmm_memory_is_charged_until_released_and_unmapped(native, instance, attacker):
    env = instance({0: 1 * GIB})
    check_vmm_sequence(Phased([str(attacker), "vmm"], env), lambda: gpu_used(native, env))


def test_a_retained_handle_keeps_the_memory_charged(instance, attacker):
    [got] = run_once(attacker, instance({0: 1 * GIB}), "retain")
    assert got["same_handle"] is True
    # Released and unmapped, but retained through the mapping first.
    assert got["free_retained"] == 512 * MIB
    assert got["creates"] == ["CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"]
    assert got["free_released"] == 512 * MIB  # the retained 512 MiB is back; the new one is held


def test_memory_mapped_after_its_handle_is_gone_is_charged_once_and_given_back_once(instance, attacker):
    # 256 MiB stay allocated throughout, so a byte given back twice would
    # show as more free memory than the instance has left.
    [got] = run_once(attacker, instance({0: 1 * GIB}), "vmm-orders")
    base = 1 * GIB - 256 * MIB
    assert got["base"] == base
    # One handle mapped twice, then released: charged once, until one
    # unmap over both mappings.
    assert got["twice"] == base - 512 * MIB
    assert got["unmapped_both"] == base
    # A second release of the same value (the simulated driver refuses it;
    # whatever a driver says): no second give-back, and the mapping still
    # holds the memory.
    assert got["release_again"] == "CUDA_ERROR_INVALID_VALUE"
    assert got["released_twice"] == base - 512 * MIB
    assert got["unmapped_once"] == base
    # Retained through the mapping after its release: the handle holds it.
    assert got["retained"] == base - 512 * MIB
    assert got["remapped"] == base - 512 * MIB
    assert got["all_gone"] == base
    assert got["cycled"] == base


def test_vmm_memory_of_a_killed_process_is_reclaimed(native, instance, attacker):
    # Killed while 1 GiB is held by mappings whose handles were released.
    env = instance({0: 1 * GIB})
    run = Phased([str(attacker), "vmm"], env)
    held = run.report()
    assert held["free"] == 0
    run.proc.kill()
    run.proc.wait(timeout=30)
    # The next process gets the whole limit back (the dead ledger is reaped).
    check_vmm_sequence(Phased([str(attacker), "vmm"], env), lambda: gpu_used(native, env))


def test_imported_memory_is_charged_to_the_importer_and_exported_memory_to_the_exporter(instance, attacker):
    # The exporter creates 512 MiB, exports it, releases its handle and
    # execs an importer that waits for the exporter to exit; both write to
    # this one pipe.
    reports = run_once(attacker, instance({0: 1 * GIB}), "export")
    exporter = next(r for r in reports if r["phase"] == 1)
    importer = next(r for r in reports if r["phase"] == 2)
    # Released but exported: the descriptor may keep it alive, so it stays
    # charged to the exporter until the exporter exits.
    assert exporter["exporter_free"] == 1 * GIB - 512 * MIB
    # The exporter is gone: the 512 MiB is the importer's to pay for.
    assert importer["import"] == "CUDA_SUCCESS"
    assert importer["importer_free"] == 1 * GIB - 512 * MIB
    assert importer["alloc_768"] == "CUDA_ERROR_OUT_OF_MEMORY"


def test_graph_memory_nodes_are_refused_under_a_limit(instance, attacker):
    [got] = run_once(attacker, instance({0: 1 * GIB}), "graph")
    assert got["add_node"] == got["add_node_v2"] == "CUDA_ERROR_NOT_SUPPORTED"
    assert got["instantiate"] == "CUDA_SUCCESS" and got["free"] == 1 * GIB


STACK_THREADS = 132 * 2048  # SMs x resident threads per SM of the simulated H100


def test_context_heap_and_stack_are_charged(native, instance, attacker):
    env = instance({0: 1 * GIB})
    [got] = run_once(attacker, env, "limits")
    assert got["heap"] == "CUDA_SUCCESS" and got["free_heap"] == 1 * GIB - 768 * MIB
    # 3 KiB more stack for every resident thread does not fit in what is left.
    assert got["stack_4k"] == "CUDA_ERROR_OUT_OF_MEMORY" and got["free_stack_4k"] == 1 * GIB - 768 * MIB
    assert got["shrink"] == "CUDA_SUCCESS" and got["free_shrink"] == 1 * GIB
    assert got["stack_2k"] == "CUDA_SUCCESS" and got["free_stack_2k"] == 1 * GIB - 1024 * STACK_THREADS


def test_the_32bit_entry_points_of_old_runtimes_are_charged_and_virtualised(instance, attacker):
    [got] = run_once(attacker, instance({0: 1 * GIB}), "oldabi")
    assert got["allocs"] == ["CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY"]
    assert got["free"] == 0 and got["total"] == 1 * GIB and got["device_total"] == 1 * GIB
    assert got["pitch"] == got["array"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert got["free_after_free"] == 512 * MIB


def _hooked_names() -> set[str]:
    return set(re.findall(r"^HOOK\((\w+), CUDA", (ROOT / "csrc/intercept/hooks.def").read_text(), re.MULTILINE))


def _entry_points() -> dict[str, set[int]]:
    """base name -> every cudaVersion at which the driver's answer changes,
    for the bases of which libcgpu hooks at least one variant."""
    defs = re.findall(
        r"^CU_FN\((\w+), (\w+), (\d+), (\w+)", (ROOT / "csrc/include/cgpu/cuda_functions.def").read_text(), re.MULTILINE
    )
    hooked = set(re.findall(r"^HOOK\((\w+)", (ROOT / "csrc/intercept/hooks.def").read_text(), re.MULTILINE))
    bases = {base for symbol, base, _, _ in defs if symbol in hooked}
    versions: dict[str, set[int]] = {b: {13000} for b in bases}
    for _, base, since, _ in defs:
        if base in bases:
            versions[base].add(int(since))
    return versions


def test_every_version_get_proc_address_hands_out_is_a_hook(instance, libcgpu):
    # Whatever variant the driver picks for a hooked base name -- for any
    # cudaVersion, either stream flavour, through cuGetProcAddress or _v2 --
    # the caller gets our hook, never the driver's function.
    cases = [
        [base, version, flags]
        for base, vs in sorted(_entry_points().items())
        for version in sorted(vs)
        for flags in (0, 1, 2)
    ]
    got = run_py(
        instance({0: GIB}),
        f"""
        import ctypes as C, json; from cudapy import Driver
        cu = Driver(); ours = C.CDLL({str(libcgpu)!r})
        hooks = {{C.cast(getattr(ours, n), C.c_void_p).value: n for n in {sorted(_hooked_names())!r}
                 if hasattr(ours, n)}}
        out = []
        for base, version, flags in {cases!r}:
            for v1 in (False, True):
                pfn = C.c_void_p()
                if v1:
                    rc = cu.lib.cuGetProcAddress(base.encode(), C.byref(pfn), version, C.c_uint64(flags))
                else:
                    rc = cu.lib.cuGetProcAddress_v2(base.encode(), C.byref(pfn), version, C.c_uint64(flags), None)
                if rc == 0 and pfn.value not in hooks:
                    out.append([base, version, flags, "v1" if v1 else "v2"])
        print(json.dumps(out))
    """,
    )
    assert got == []
