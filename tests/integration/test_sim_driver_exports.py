"""The simulated libcuda.so.1 as a real driver looks from outside: every
entry point exported, the unmodelled ones answering
CUDA_ERROR_NOT_SUPPORTED, cuGetProcAddress answering every (name, version,
variant) the headers know with the function of that name, and the ordinary
calls frameworks make at start (pinned host memory, copies, P2P attributes,
cache configuration, limits) behaving, from a program built against
NVIDIA's cuda.h."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import cudakit
from tests.harness.cc import compile_strict
from tests.harness.sim import write_sim_config
from tests.harness.simrun import run_py

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
CUDA_ERROR_NOT_SUPPORTED = 801
CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2


def real_cuda_include() -> Path:
    """NVIDIA's cuda.h: the default CUDA line's (tests/harness/cudakit.py)."""
    return cudakit.toolkit().header("cuda.h").parent


def _rows() -> list[tuple[str, str, int, str]]:
    """(symbol, base, since, kind) of every cuGetProcAddress answer."""
    modelled = re.findall(
        r"^CU_FN\((\w+),\s*(\w+),\s*(\d+),\s*(\w+),",
        (CSRC / "include/cgpu/cuda_functions.def").read_text(),
        re.MULTILINE,
    )
    stubs = re.findall(
        r"^CU_PROC\((\w+),\s*(\w+),\s*(\d+),\s*(\w+)\)", (CSRC / "simgpu/cuda_unmodelled.def").read_text(), re.MULTILINE
    )
    return [(s, b, int(v), k) for s, b, v, k in modelled + stubs]


def _stubs() -> list[str]:
    return re.findall(r"^CU_STUB\((\w+),", (CSRC / "simgpu/cuda_unmodelled.def").read_text(), re.MULTILINE)


# What a runtime asks, and which exported function (by dlsym in the same
# process) it gets: [cuGetProcAddress_v2's result, its symbolStatus, the
# name whose address came back, cuGetProcAddress's result, its name].
RESOLVE = """
import ctypes as C, json, sys
lib = C.CDLL("libcuda.so.1")
lib.cuInit(0)
queries, names = json.loads(sys.argv[1])
by_addr = {C.cast(getattr(lib, s), C.c_void_p).value: s for s in names}
out = []
for base, version, flags in queries:
    fn, status, old_fn = C.c_void_p(), C.c_int(-1), C.c_void_p()
    rc = lib.cuGetProcAddress_v2(base.encode(), C.byref(fn), version, C.c_uint64(flags), C.byref(status))
    old_rc = lib.cuGetProcAddress(base.encode(), C.byref(old_fn), version, C.c_uint64(flags))
    out.append([rc, status.value, by_addr.get(fn.value, fn.value), old_rc, by_addr.get(old_fn.value, old_fn.value)])
print(json.dumps(out))
"""


def _run(sim_env: dict[str, str], code: str, arg: object) -> object:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), json.dumps(arg)],
        env=sim_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _resolve(sim_env, queries: list[tuple[str, int, int]], names: list[str]) -> list[list[object]]:
    return _run(sim_env, RESOLVE, [queries, names])  # type: ignore[return-value]


def test_every_answer_the_headers_know_resolves_to_its_function(sim_env):
    rows = _rows()
    assert len(rows) > 600
    queries = [(b, v, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if k == "PTSZ" else 0) for _, b, v, k in rows]
    got = _resolve(sim_env, queries, sorted({s for s, *_ in rows}))
    wrong = [(row, res) for row, res in zip(rows, got) if res != [0, 0, row[0], 0, row[0]]]
    assert wrong == []


SAMPLES = [
    # base, cudaVersion, flags -> exported name
    ("cuMemAlloc", 2000, 0, "cuMemAlloc"),
    ("cuMemAlloc", 13000, 0, "cuMemAlloc_v2"),
    ("cuMemAlloc", 13000, 2, "cuMemAlloc_v2"),  # no per-thread variant: the default one
    ("cuMemcpyHtoD", 13000, 2, "cuMemcpyHtoD_v2_ptds"),
    ("cuMemcpyHtoD", 13000, 1, "cuMemcpyHtoD_v2"),  # CU_GET_PROC_ADDRESS_LEGACY_STREAM
    ("cuMemcpyHtoD", 6050, 2, "cuMemcpyHtoD_v2"),  # per-thread variants began with 7.0
    ("cuMemcpyHtoD", 3000, 0, "cuMemcpyHtoD"),
    ("cuStreamBeginCapture", 10000, 2, "cuStreamBeginCapture_ptsz"),
    ("cuStreamBeginCapture", 13000, 2, "cuStreamBeginCapture_v2_ptsz"),
    ("cuStreamGetCaptureInfo", 11080, 0, "cuStreamGetCaptureInfo_v2"),
    ("cuStreamGetCaptureInfo", 13000, 2, "cuStreamGetCaptureInfo_v3_ptsz"),
    ("cuCtxCreate", 11040, 0, "cuCtxCreate_v3"),
    ("cuCtxCreate", 13000, 0, "cuCtxCreate_v4"),
    ("cuCtxDestroy", 3020, 0, "cuCtxDestroy"),
    ("cuCtxDestroy", 4000, 0, "cuCtxDestroy_v2"),
    ("cuEventElapsedTime", 12080, 0, "cuEventElapsedTime_v2"),
    ("cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2"),
    ("cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags"),
    ("cuTexRefSetAddress2D", 4010, 0, "cuTexRefSetAddress2D_v3"),
    ("cuMemAdvise", 12020, 0, "cuMemAdvise_v2"),
    ("cuMemAllocHost", 13000, 0, "cuMemAllocHost_v2"),
    ("cuMemHostRegister", 6050, 0, "cuMemHostRegister_v2"),
    ("cuGetExportTable", 13000, 0, "cuGetExportTable"),
    ("cuGetProcAddress", 13000, 0, "cuGetProcAddress_v2"),
]


def test_a_sample_of_queries_resolves_as_a_real_driver(sim_env):
    got = _resolve(sim_env, [(b, v, f) for b, v, f, _ in SAMPLES], sorted({s for *_, s in SAMPLES}))
    assert [(b, v, f, r) for (b, v, f, _), r in zip(SAMPLES, got)] == [
        (b, v, f, [0, 0, s, 0, s]) for b, v, f, s in SAMPLES
    ]


def test_queries_it_cannot_answer_say_why(sim_env):
    got = _resolve(
        sim_env,
        [
            ("cuLogsCurrent", 12080, 0),  # added in 12.9: too new for a 12.8 runtime
            ("cuMemcpyBatchAsync", 12000, 2),
            ("cuNoSuchFunction", 13000, 0),
            ("cuMemAlloc_v2", 13000, 0),  # exported names are not base names
        ],
        [],
    )
    CUDA_ERROR_NOT_FOUND, SYMBOL_NOT_FOUND, VERSION_NOT_SUFFICIENT = 500, 1, 2
    assert got == [
        [CUDA_ERROR_NOT_FOUND, VERSION_NOT_SUFFICIENT, None, CUDA_ERROR_NOT_FOUND, None],
        [CUDA_ERROR_NOT_FOUND, VERSION_NOT_SUFFICIENT, None, CUDA_ERROR_NOT_FOUND, None],
        [CUDA_ERROR_NOT_FOUND, SYMBOL_NOT_FOUND, None, CUDA_ERROR_NOT_FOUND, None],
        [CUDA_ERROR_NOT_FOUND, SYMBOL_NOT_FOUND, None, CUDA_ERROR_NOT_FOUND, None],
    ]


def test_every_stub_answers_not_supported(sim_env):
    # Stubs read no argument, so calling them bare is what any caller gets.
    stubs = _stubs()
    assert len(stubs) > 300
    got = _run(
        sim_env,
        """
        import ctypes as C, json, sys
        lib = C.CDLL("libcuda.so.1")
        print(json.dumps({s: getattr(lib, s)() for s in json.loads(sys.argv[1])}))
    """,
        stubs,
    )
    assert {s for s, rc in got.items() if rc != CUDA_ERROR_NOT_SUPPORTED} == set()


def _build_calls(out: Path, lib_dir: Path, *flags: str) -> Path:
    return compile_strict(
        out / "sim_driver_calls",
        *flags,
        f"-I{real_cuda_include()}",
        str(Path(__file__).with_name("sim_driver_calls.c")),
        f"-L{lib_dir}",
        "-l:libcuda.so.1",
    )


@pytest.fixture(scope="module")
def calls_program(native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_calls(tmp_path_factory.mktemp("driver-calls"), native / "sim")


def _run_calls(exe: Path, sim_env: dict[str, str]) -> dict[str, object]:
    # GPUs of 1 GiB, 2 GiB pinned: pinned memory is host memory.
    write_sim_config(Path(sim_env["CGPU_SIM_CONFIG"]), mem="1GiB")
    proc = subprocess.run([str(exe), str(2 << 30)], env=sim_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_program_built_against_cuda_h_pins_copies_and_queries(calls_program, sim_env):
    got = _run_calls(calls_program, sim_env)
    assert got["first_fail_line"] == 0, got
    assert got["total"] == 1 << 30
    assert got["huge"] == 0
    assert got["free_pinned"] == got["free_before"]  # 2 GiB pinned, nothing charged
    assert got["free_before"] - got["free_device"] == 2 << 20  # the two device buffers
    assert got["roundtrip"] == 1
    assert got["past_end"] == 1  # CUDA_ERROR_INVALID_VALUE
    assert got["mapped_is_host"] == 1  # unified addressing
    assert got["flags"] == 0x3  # portable and mapped, as with unified addressing
    assert got["unregister"] == [0, 713]  # then CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    assert got["register_twice"] == 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert got["free_pageable"] == 1
    assert got["p2p"] == [0, 0, 101]  # no NVLink in this config; same device: invalid
    assert got["cache"] == 2  # CU_FUNC_CACHE_PREFER_L1
    assert got["stack"] == 1024
    assert got["priority"] == [0, -5, -5]  # clamped to the greatest
    assert got["ctx_flags"] == 0
    assert got["stub"] == CUDA_ERROR_NOT_SUPPORTED
    assert got["types"] == [2, 1, 0]  # device, host, unregistered
    assert got["pool_used"] == 4096
    assert got["block_ok"] == 1  # 2D copies both ways and a 2D fill, at the right pitch
    assert got["array"] == CUDA_ERROR_NOT_SUPPORTED  # arrays hold no bytes here
    assert got["d16_ok"] == 1 and got["peer_ok"] == 1


def test_pinned_memory_is_not_device_memory_across_processes(sim_env):
    # One process pins 4 GiB and holds it; another sees the GPU whole.
    got = run_py(
        sim_env,
        """
        import ctypes as C, json, subprocess, sys
        from cudapy import Driver
        cu = Driver(); cu.init_device(0)
        p = C.c_void_p()
        rc = cu.rc("cuMemHostAlloc", C.byref(p), C.c_size_t(4 << 30), 0)
        other = subprocess.run([sys.executable, "-c",
            "import json; from cudapy import Driver; cu = Driver(); cu.init_device(0); print(json.dumps(cu.mem_info()))"],
            capture_output=True, text=True, check=True).stdout
        freed = cu.rc("cuMemFreeHost", p)
        print(json.dumps([rc, json.loads(other), freed, cu.rc("cuMemFreeHost", p)]))
    """,
    )
    assert got[0] == "CUDA_SUCCESS"
    free, total = got[1]
    assert total == 16 << 30 and total - free < 1 << 30  # only the contexts' memory
    assert got[2:] == ["CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE"]


def test_pointer_attributes_tell_device_managed_pool_and_pinned_memory(sim_env):
    got = run_py(
        sim_env,
        """
        import ctypes as C, json
        from cudapy import Driver
        cu = Driver(); ctx = cu.init_device(1)
        MEMORY_TYPE, DEVICE_POINTER, HOST_POINTER, BUFFER_ID, IS_MANAGED, ORDINAL, IPC, START, SIZE, POOL = (
            2, 3, 4, 7, 8, 9, 10, 11, 12, 17)
        def attrs(p):
            mt, dp, hp, bid, man, ordl, ipc, start, size, pool = (C.c_uint(), C.c_uint64(), C.c_void_p(),
                C.c_ulonglong(), C.c_bool(), C.c_int(), C.c_bool(), C.c_uint64(), C.c_size_t(), C.c_void_p())
            rcs = [cu.rc("cuPointerGetAttribute", C.byref(v), a, C.c_uint64(p)) for v, a in (
                (mt, MEMORY_TYPE), (dp, DEVICE_POINTER), (hp, HOST_POINTER), (bid, BUFFER_ID), (man, IS_MANAGED),
                (ordl, ORDINAL), (ipc, IPC), (start, START), (size, SIZE), (pool, POOL))]
            return {"rc": sorted(set(rcs)), "type": mt.value, "dev_is_p": dp.value == p, "host": hp.value,
                    "id": bid.value, "managed": man.value, "ordinal": ordl.value, "ipc": ipc.value,
                    "start_off": p - start.value, "size": size.value, "pool": pool.value}
        dev, man = C.c_uint64(), C.c_uint64()
        cu.call("cuMemAlloc_v2", C.byref(dev), C.c_size_t(1 << 20))
        cu.call("cuMemAllocManaged", C.byref(man), C.c_size_t(4096), 1)
        pool = C.c_void_p(); cu.call("cuDeviceGetMemPool", C.byref(pool), 1)
        asy = C.c_uint64(); cu.call("cuMemAllocAsync", C.byref(asy), C.c_size_t(3 << 20), None)
        used = C.c_uint64(); cu.call("cuMemPoolGetAttribute", pool, 7, C.byref(used))  # USED_MEM_CURRENT
        thr = C.c_uint64(1 << 30); cu.call("cuMemPoolSetAttribute", pool, 4, C.byref(thr))  # RELEASE_THRESHOLD
        thr_back = C.c_uint64(); cu.call("cuMemPoolGetAttribute", pool, 4, C.byref(thr_back))
        host = C.c_void_p(); cu.call("cuMemAllocHost_v2", C.byref(host), C.c_size_t(8192))
        out = {"dev": attrs(dev.value + 100), "managed": attrs(man.value), "async": attrs(asy.value),
               "pinned": attrs(host.value + 8), "pool": pool.value, "used": used.value, "threshold": thr_back.value}
        cu.call("cuMemFreeAsync", asy, None)
        cu.call("cuMemPoolGetAttribute", pool, 7, C.byref(used)); out["used_after"] = used.value
        high = C.c_uint64(); cu.call("cuMemPoolGetAttribute", pool, 8, C.byref(high)); out["high"] = high.value
        junk = C.create_string_buffer(64)
        out["unknown"] = cu.rc("cuPointerGetAttribute", C.byref(C.c_uint()), MEMORY_TYPE, C.c_uint64(C.addressof(junk)))
        mt = C.c_uint(7); data = (C.c_void_p * 1)(C.cast(C.byref(mt), C.c_void_p)); which = (C.c_int * 1)(MEMORY_TYPE)
        out["unknown_many"] = [cu.rc("cuPointerGetAttributes", 1, which, data, C.c_uint64(C.addressof(junk))), mt.value]
        print(json.dumps(out))
    """,
    )
    dev, managed, asy, pinned = got["dev"], got["managed"], got["async"], got["pinned"]
    assert dev == {
        "rc": ["CUDA_ERROR_INVALID_VALUE", "CUDA_SUCCESS"],
        "type": 2,
        "dev_is_p": True,
        "host": None,
        "id": dev["id"],
        "managed": False,
        "ordinal": 1,
        "ipc": True,
        "start_off": 100,
        "size": 1 << 20,
        "pool": None,
    }  # no host pointer to device memory
    assert managed["rc"] == ["CUDA_SUCCESS"] and managed["managed"] and not managed["ipc"] and managed["host"]
    assert asy["pool"] == got["pool"] and asy["size"] == 3 << 20 and not asy["ipc"]
    assert pinned["rc"] == ["CUDA_SUCCESS"] and pinned["type"] == 1 and pinned["start_off"] == 8
    assert pinned["size"] == 8192 and pinned["host"] is not None
    assert len({dev["id"], managed["id"], asy["id"], pinned["id"]}) == 4
    assert got["used"] == 3 << 20 and got["used_after"] == 0 and got["high"] == 3 << 20
    assert got["threshold"] == 1 << 30
    assert got["unknown"] == "CUDA_ERROR_INVALID_VALUE"
    assert got["unknown_many"] == ["CUDA_SUCCESS", 0]  # unregistered memory


def test_function_attributes_have_defaults_and_take_what_may_be_set(sim_env):
    got = run_py(
        sim_env,
        """
        import ctypes as C, json
        from cudapy import Driver
        cu = Driver(); primary = cu.init_device(0); fn = cu.spin_function()
        def get(a):
            v = C.c_int(-99); rc = cu.rc("cuFuncGetAttribute", C.byref(v), a, fn); return [rc, v.value]
        out = {"max_threads": get(0), "binary": get(6), "dyn_shared": get(8), "carveout": get(9)}
        out["set_dyn"] = cu.rc("cuFuncSetAttribute", fn, 8, 100000)
        out["dyn_after"] = get(8)
        out["set_too_much"] = cu.rc("cuFuncSetAttribute", fn, 8, 300000)
        out["set_read_only"] = cu.rc("cuFuncSetAttribute", fn, 4, 32)
        out["bad_attr"] = get(99)
        out["cache"] = [cu.rc("cuFuncSetCacheConfig", fn, 1), cu.rc("cuFuncSetCacheConfig", fn, 9)]
        ctx = C.c_void_p()
        out["stream_ctx"] = [cu.rc("cuStreamGetCtx", None, C.byref(ctx)), ctx.value == primary.value]
        print(json.dumps(out))
    """,
    )
    assert got["max_threads"] == ["CUDA_SUCCESS", 1024]
    assert got["binary"] == ["CUDA_SUCCESS", 90]  # the config's compute capability 9.0
    assert got["dyn_shared"] == ["CUDA_SUCCESS", 49152] and got["carveout"] == ["CUDA_SUCCESS", -1]
    assert got["set_dyn"] == "CUDA_SUCCESS" and got["dyn_after"] == ["CUDA_SUCCESS", 100000]
    assert got["set_too_much"] == got["set_read_only"] == "CUDA_ERROR_INVALID_VALUE"
    assert got["bad_attr"][0] == "CUDA_ERROR_INVALID_VALUE"
    assert got["cache"] == ["CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE"]
    assert got["stream_ctx"] == ["CUDA_SUCCESS", True]  # the NULL stream's: the current context


def test_pinning_and_copies_are_clean_under_sanitizers(sim_env, tmp_path):
    # The simulated driver and the program both built with ASan/UBSan (leaks
    # included): the copies' backing, the pinned records, the pools.
    sys.path.insert(0, str(CSRC))
    import build_native

    target = next(t for t in build_native.TARGETS if t.output == "sim/libcuda.so.1")
    build_native.compile_target(target, tmp_path, build_native.SANITIZE)
    exe = _build_calls(tmp_path, tmp_path / "sim", *build_native.SANITIZE_FLAGS)
    env = dict(
        sim_env,
        LD_LIBRARY_PATH=str(tmp_path / "sim"),
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=86",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87",
    )
    got = _run_calls(exe, env)
    assert got["first_fail_line"] == 0 and got["roundtrip"] == 1


def test_occupancy_follows_threads_shared_memory_and_limits(sim_env):
    got = run_py(
        sim_env,
        """
        import ctypes as C, json
        from cudapy import Driver
        cu = Driver(); cu.init_device(0); fn = cu.spin_function()
        def blocks(size, smem, flags=0):
            n = C.c_int(-1)
            rc = cu.rc("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", C.byref(n), fn, size, C.c_size_t(smem), flags)
            return [rc, n.value]
        def best(limit, smem=0, per_block=None):
            grid, block = C.c_int(-1), C.c_int(-1)
            cb = C.CFUNCTYPE(C.c_size_t, C.c_int)(per_block) if per_block else None
            rc = cu.rc("cuOccupancyMaxPotentialBlockSize", C.byref(grid), C.byref(block), fn, cb, C.c_size_t(smem), limit)
            return [rc, grid.value, block.value]
        print(json.dumps({
            "b256": blocks(256, 0), "b1024": blocks(1024, 0), "b96": blocks(96, 0),
            "smem": blocks(128, 40000), "too_much_smem": blocks(128, 100000), "too_big": blocks(2048, 0),
            "bad_flags": blocks(128, 0, 4)[0], "zero": blocks(0, 0)[0],
            "best": best(0), "best_100": best(100), "best_cb": best(0, per_block=lambda b: 48 * b),
        }))
    """,
    )
    assert got["b256"] == ["CUDA_SUCCESS", 8] and got["b1024"] == ["CUDA_SUCCESS", 2]  # 2048 threads an SM
    assert got["b96"] == ["CUDA_SUCCESS", 21]
    assert got["smem"] == ["CUDA_SUCCESS", 5]  # 228 KiB of shared memory an SM
    assert got["too_much_smem"] == got["too_big"] == ["CUDA_SUCCESS", 0]
    assert got["bad_flags"] == got["zero"] == "CUDA_ERROR_INVALID_VALUE"
    assert got["best"] == ["CUDA_SUCCESS", 2 * 132, 1024]
    # at most 100 threads: 64-thread blocks fill an SM (32 blocks), 96 or 100 do not
    assert got["best_100"] == ["CUDA_SUCCESS", 32 * 132, 64]
    # 48 bytes of shared memory a thread: 1024 threads need 48 KiB (fits 4 an SM by memory, 2 by threads)
    assert got["best_cb"][0] == "CUDA_SUCCESS" and got["best_cb"][2] == 1024


def test_managed_hints_ids_and_event_flags(sim_env):
    got = run_py(
        sim_env,
        """
        import ctypes as C, json
        from cudapy import Driver
        cu = Driver(); ctx = cu.init_device(0)
        class Loc(C.Structure):
            _fields_ = [("type", C.c_int), ("id", C.c_int)]
        man, dev = C.c_uint64(), C.c_uint64()
        cu.call("cuMemAllocManaged", C.byref(man), C.c_size_t(1 << 20), 1)
        cu.call("cuMemAlloc_v2", C.byref(dev), C.c_size_t(1 << 20))
        n = C.c_size_t
        out = {
            "advise": cu.rc("cuMemAdvise_v2", man, n(4096), 3, Loc(1, 0)),  # preferred location: GPU 0
            "advise_cpu": cu.rc("cuMemAdvise", man, n(4096), 5, -1),  # accessed by the host
            "advise_bad_gpu": cu.rc("cuMemAdvise", man, n(4096), 3, 7),
            "advise_device_mem": cu.rc("cuMemAdvise_v2", dev, n(4096), 1, Loc(1, 0)),
            "advise_past_end": cu.rc("cuMemAdvise_v2", man, n(2 << 20), 1, Loc(1, 0)),
            "prefetch": cu.rc("cuMemPrefetchAsync_v2", man, n(1 << 20), Loc(2, 0), 0, None),
            "prefetch_ptsz": cu.rc("cuMemPrefetchAsync_ptsz", man, n(1 << 20), 1, None),
        }
        ids = []
        for name, h in (("cuCtxGetId", ctx), ("cuCtxGetId", None), ("cuStreamGetId", None)):
            v = C.c_ulonglong(); ids.append([cu.rc(name, h, C.byref(v)), v.value])
        s = C.c_void_p(); cu.call("cuStreamCreate", C.byref(s), 0)
        v = C.c_ulonglong(); ids.append([cu.rc("cuStreamGetId", s, C.byref(v)), v.value])
        v = C.c_ulonglong(); ids.append([cu.rc("cuStreamGetId_ptsz", None, C.byref(v)), v.value])
        out["ids"] = ids
        ev = C.c_void_p(); cu.call("cuEventCreate", C.byref(ev), 0)
        out["record"] = [cu.rc("cuEventRecordWithFlags", ev, s, 0), cu.rc("cuEventRecordWithFlags_ptsz", ev, None, 1),
                         cu.rc("cuEventRecordWithFlags", ev, s, 2), cu.rc("cuEventQuery", ev)]
        print(json.dumps(out))
    """,
    )
    assert got["advise"] == got["advise_cpu"] == got["prefetch"] == got["prefetch_ptsz"] == "CUDA_SUCCESS"
    assert got["advise_bad_gpu"] == "CUDA_ERROR_INVALID_DEVICE"
    assert got["advise_device_mem"] == got["advise_past_end"] == "CUDA_ERROR_INVALID_VALUE"  # managed memory only
    ctx_id, ctx_id_again, legacy, created, per_thread = got["ids"]
    assert all(rc == "CUDA_SUCCESS" for rc, _ in got["ids"])
    assert ctx_id == ctx_id_again  # the current context is the primary one
    assert len({legacy[1], created[1], per_thread[1], ctx_id[1]}) == 4 and 0 not in {legacy[1], created[1]}
    assert got["record"] == ["CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", "CUDA_SUCCESS"]


def test_host_functions_run_after_the_work_queued_before_them(sim_env):
    got = run_py(
        sim_env,
        """
        import ctypes as C, json, time
        from cudapy import Driver
        cu = Driver(); cu.init_device(0); fn = cu.spin_function()
        s = C.c_void_p(); cu.call("cuStreamCreate", C.byref(s), 0)
        seen = []
        HOST = C.CFUNCTYPE(None, C.c_void_p)
        CALLBACK = C.CFUNCTYPE(None, C.c_void_p, C.c_int, C.c_void_p)
        host = HOST(lambda data: seen.append(["host", time.monotonic_ns(), data]))
        cb = CALLBACK(lambda stream, status, data: seen.append(["cb", time.monotonic_ns(), stream == s.value, status, data]))
        t0 = time.monotonic_ns()
        cu.launch_spin(fn, 50_000_000, s)
        rcs = [cu.rc("cuLaunchHostFunc", s, host, C.c_void_p(7)),
               cu.rc("cuStreamAddCallback_ptsz", s, cb, C.c_void_p(9), 0),
               cu.rc("cuStreamAddCallback", s, cb, None, 1), cu.rc("cuLaunchHostFunc", s, None, None)]
        cap = C.c_void_p(); cu.call("cuStreamCreate", C.byref(cap), 1)
        cu.call("cuStreamBeginCapture_v2", cap, 0)
        rcs.append(cu.rc("cuLaunchHostFunc", cap, host, None))
        graph = C.c_void_p(); cu.call("cuStreamEndCapture", cap, C.byref(graph))
        print(json.dumps({"rcs": rcs, "seen": [[k, (t - t0) // 1_000_000, *rest] for k, t, *rest in seen]}))
    """,
    )
    assert got["rcs"] == [
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
    ]
    (host, host_ms, host_data), (cb, cb_ms, same_stream, status, cb_data) = got["seen"]
    assert (host, host_data, cb, same_stream, status, cb_data) == ("host", 7, "cb", True, 0, 9)
    assert 49 <= host_ms <= cb_ms < 1000  # after the 50 ms kernel, in order


IPC_CHILD = """
import ctypes as C, json, sys
from cudapy import Driver
class Handle(C.Structure):
    _fields_ = [("reserved", C.c_char * 64)]
cu = Driver(); cu.init_device(0)
free_before = cu.mem_info()[0]
h = Handle.from_buffer_copy(bytes.fromhex(sys.argv[1]))
p = C.c_uint64()
rc = cu.rc("cuIpcOpenMemHandle_v2", C.byref(p), h, 1)
buf = C.create_string_buffer(16)
cu.call("cuMemcpyDtoH_v2", buf, p, C.c_size_t(16))
cu.call("cuMemcpyHtoD_v2", C.c_uint64(p.value + 8), b"from-kid", C.c_size_t(8))
print(json.dumps([rc, buf.raw[:8].decode(), free_before - cu.mem_info()[0], cu.rc("cuMemFree_v2", p),
                  cu.rc("cuIpcCloseMemHandle", p), cu.rc("cuIpcCloseMemHandle", p)]))
"""


def test_ipc_handles_share_the_bytes_and_charge_only_the_exporter(sim_env):
    got = run_py(
        sim_env,
        f"""
        import ctypes as C, json, subprocess, sys
        from cudapy import Driver
        class Handle(C.Structure):
            _fields_ = [("reserved", C.c_char * 64)]
        cu = Driver(); cu.init_device(0)
        p = C.c_uint64(); cu.call("cuMemAlloc_v2", C.byref(p), C.c_size_t(1 << 20))
        cu.call("cuMemcpyHtoD_v2", p, b"parent!!", C.c_size_t(8))
        h = Handle(); rc = cu.rc("cuIpcGetMemHandle", C.byref(h), C.c_uint64(p.value + 4096))
        kid = subprocess.run([sys.executable, "-c", {IPC_CHILD!r}, bytes(h).hex()],
                             capture_output=True, text=True)
        back = C.create_string_buffer(16); cu.call("cuMemcpyDtoH_v2", back, p, C.c_size_t(16))
        man = C.c_uint64(); cu.call("cuMemAllocManaged", C.byref(man), C.c_size_t(4096), 1)
        print(json.dumps({{"rc": rc, "kid": json.loads(kid.stdout) if kid.returncode == 0 else kid.stderr,
                          "back": back.raw.decode(), "managed": cu.rc("cuIpcGetMemHandle", C.byref(h), man)}}))
    """,
    )
    assert got["rc"] == "CUDA_SUCCESS"
    opened, seen, charged, free_rc, close_rc, close_again = got["kid"]
    assert opened == "CUDA_SUCCESS" and seen == "parent!!" and charged == 0
    assert (free_rc, close_rc, close_again) == ("CUDA_ERROR_INVALID_VALUE", "CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE")
    assert got["back"] == "parent!!from-kid"  # the child's write is in the parent's memory
    assert got["managed"] == "CUDA_ERROR_INVALID_VALUE"  # only cuMemAlloc's memory has legacy IPC
