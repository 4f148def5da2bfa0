"""MIG on the simulated GPUs: a GPU booted in MIG mode with a layout of GPU
instances (config key `mig=`), as NVML (pynvml and raw ctypes) and the CUDA
driver see it. Every program runs in a subprocess on a private machine."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness.nvml_clients import NVITOP
from tests.harness.sim import sim_env_in
from tests.harness.simrun import PYNVML, py_env, run_py

GIB = 1 << 30
MIB = 1 << 20
PARENT = "GPU-5c1a0000-0000-4000-8000-000000c90000"
# The layout every test boots: GPU 0 in MIG mode, GPU 1 whole.
LAYOUT = "mig=3g.40gb,2g.20gb,1g.10gb"


@pytest.fixture
def mig_env(tmp_path: Path, native: Path) -> dict[str, str]:
    return sim_env_in(tmp_path / "mig", native, mem="80GiB", placements=[LAYOUT])


def nvml(env: dict[str, str], body: str) -> object:
    return run_py(env, PYNVML + textwrap.dedent(body))


def mig_uuids(env: dict[str, str]) -> list[str]:
    return nvml(  # type: ignore[return-value]
        env,
        """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        print(json.dumps([n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)) for i in range(3)]))
        """,
    )


def test_nvml_shows_mig_mode_and_each_mig_device_with_its_own_memory_and_sms(mig_env):
    got = nvml(
        mig_env,
        """
        n.nvmlInit()
        out = {"gpus": [], "migs": []}
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            out["gpus"].append([n.nvmlDeviceGetMigMode(h), n.nvmlDeviceGetMaxMigDeviceCount(h),
                                n.nvmlDeviceIsMigDeviceHandle(h).value])
        h = n.nvmlDeviceGetHandleByIndex(0)
        for j in range(7):
            try:
                m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except n.NVMLError_NotFound:
                out["migs"].append(None)
                continue
            a = n.nvmlDeviceGetAttributes(m)
            out["migs"].append({
                "name": n.nvmlDeviceGetName(m), "uuid": n.nvmlDeviceGetUUID(m),
                "gi": n.nvmlDeviceGetGpuInstanceId(m), "ci": n.nvmlDeviceGetComputeInstanceId(m),
                "sms": a.multiprocessorCount, "mb": a.memorySizeMB, "gi_slices": a.gpuInstanceSliceCount,
                "ci_slices": a.computeInstanceSliceCount, "total": n.nvmlDeviceGetMemoryInfo(m).total,
                "is_mig": n.nvmlDeviceIsMigDeviceHandle(m).value,
                "parent": n.nvmlDeviceGetUUID(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)),
                "by_uuid": addr(n.nvmlDeviceGetHandleByUUID(n.nvmlDeviceGetUUID(m))) == addr(m),
                "mig_mode_of_mig_handle": err(lambda: n.nvmlDeviceGetMigMode(m)),
            })
        whole = n.nvmlDeviceGetHandleByIndex(1)
        out["whole"] = [err(lambda: n.nvmlDeviceGetMigDeviceHandleByIndex(whole, 0)),
                        err(lambda: n.nvmlDeviceGetGpuInstanceId(whole)),
                        err(lambda: n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(whole))]
        print(json.dumps(out))
        """,
    )
    assert got["gpus"] == [[[1, 1], 7, 0], [[0, 0], 0, 0]]
    migs = got["migs"]
    assert migs[3:] == [None] * 4
    assert [m["name"] for m in migs[:3]] == [
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        "NVIDIA H100 80GB HBM3 MIG 2g.20gb",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
    ]
    # GPU instance ids by placement: halves 1-2, quarters 3-6, eighths 7-14.
    assert [(m["gi"], m["ci"]) for m in migs[:3]] == [(1, 0), (5, 0), (13, 0)]
    assert [(m["sms"], m["mb"], m["gi_slices"], m["ci_slices"]) for m in migs[:3]] == [
        (60, 40448, 3, 3),
        (32, 20096, 2, 2),
        (16, 9984, 1, 1),
    ]
    assert [m["total"] for m in migs[:3]] == [40448 * MIB, 20096 * MIB, 9984 * MIB]
    assert all(m["uuid"].startswith("MIG-") and m["is_mig"] == 1 and m["parent"] == PARENT for m in migs[:3])
    assert len({m["uuid"] for m in migs[:3]}) == 3
    assert all(m["by_uuid"] for m in migs[:3])
    assert all(m["mig_mode_of_mig_handle"] == "NVMLError_InvalidArgument" for m in migs[:3])
    assert got["whole"] == ["NVMLError_NotSupported", "NVMLError_NotSupported", "NVMLError_InvalidArgument"]


def test_gpu_and_compute_instances_through_raw_nvml(mig_env):
    """The instance calls through ctypes with NVML's own struct layouts."""
    got = run_py(
        mig_env,
        """
        import ctypes as C, json
        lib = C.CDLL("libnvidia-ml.so.1")
        assert lib.nvmlInit_v2() == 0
        h = C.c_void_p(); assert lib.nvmlDeviceGetHandleByIndex_v2(0, C.byref(h)) == 0
        class Placement(C.Structure): _fields_ = [("start", C.c_uint), ("size", C.c_uint)]
        class ProfileV2(C.Structure):
            _fields_ = [("version", C.c_uint), ("id", C.c_uint), ("p2p", C.c_uint), ("slices", C.c_uint),
                        ("count", C.c_uint), ("sms", C.c_uint), ("ce", C.c_uint), ("dec", C.c_uint),
                        ("enc", C.c_uint), ("jpg", C.c_uint), ("ofa", C.c_uint), ("mb", C.c_ulonglong),
                        ("name", C.c_char * 96)]
        class GiInfo(C.Structure):
            _fields_ = [("device", C.c_void_p), ("id", C.c_uint), ("profileId", C.c_uint), ("placement", Placement)]
        class CiInfo(C.Structure):
            _fields_ = [("device", C.c_void_p), ("gi", C.c_void_p), ("id", C.c_uint), ("profileId", C.c_uint),
                        ("placement", Placement)]
        out = {"profiles": [], "instances": []}
        for index in range(10):
            p = ProfileV2(version=C.sizeof(ProfileV2) | (2 << 24))
            rc = lib.nvmlDeviceGetGpuInstanceProfileInfoV(h, index, C.byref(p))
            if rc:
                out["profiles"].append(rc)
                continue
            n = C.c_uint(0)
            assert lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(h, p.id, None, C.byref(n)) == 0
            places = (Placement * n.value)()
            assert lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(h, p.id, places, C.byref(n)) == 0
            out["profiles"].append([p.name.decode(), p.id, p.slices, p.count, p.sms, p.mb,
                                    [(x.start, x.size) for x in places]])
            gis = (C.c_void_p * p.count)(); got = C.c_uint(0)
            assert lib.nvmlDeviceGetGpuInstances(h, p.id, gis, C.byref(got)) == 0
            for gi in gis[: got.value]:
                info = GiInfo(); assert lib.nvmlGpuInstanceGetInfo(C.c_void_p(gi), C.byref(info)) == 0
                cis = (C.c_void_p * 8)(); nci = C.c_uint(0)
                ci_profile = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[p.slices]
                assert lib.nvmlGpuInstanceGetComputeInstances(C.c_void_p(gi), ci_profile, cis, C.byref(nci)) == 0
                ci = CiInfo(); assert lib.nvmlComputeInstanceGetInfo_v2(C.c_void_p(cis[0]), C.byref(ci)) == 0
                out["instances"].append([p.name.decode(), info.id, info.profileId, info.placement.start,
                                         info.placement.size, info.device == h.value, nci.value, ci.id,
                                         ci.profileId, ci.placement.size, ci.gi == gi])
        print(json.dumps(out))
        """,
    )
    not_supported = 3
    assert got["profiles"] == [
        ["MIG 1g.10gb", 19, 1, 7, 16, 9984, [[s, 1] for s in range(7)]],
        ["MIG 2g.20gb", 14, 2, 3, 32, 20096, [[0, 2], [2, 2], [4, 2]]],
        ["MIG 3g.40gb", 9, 3, 2, 60, 40448, [[0, 4], [4, 4]]],
        ["MIG 4g.40gb", 5, 4, 1, 64, 40448, [[0, 4]]],
        ["MIG 7g.80gb", 0, 7, 1, 132, 81152, [[0, 8]]],
        not_supported,  # 8_SLICE
        not_supported,  # 6_SLICE
        ["MIG 1g.10gb+me", 20, 1, 1, 16, 9984, [[s, 1] for s in range(7)]],
        not_supported,  # 2_SLICE_REV1
        ["MIG 1g.20gb", 15, 1, 4, 26, 20096, [[0, 2], [2, 2], [4, 2], [6, 2]]],
    ]
    assert [tuple(i) for i in got["instances"]] == [
        ("MIG 1g.10gb", 13, 19, 6, 1, True, 1, 0, 0, 1, True),
        ("MIG 2g.20gb", 5, 14, 4, 2, True, 1, 0, 1, 2, True),
        ("MIG 3g.40gb", 1, 9, 0, 4, True, 1, 0, 2, 3, True),
    ]


CUDA_VIEW = """
import ctypes as C, json
from cudapy import Driver
cu = Driver()
rc = cu.rc("cuInit", 0)
out = {"init": rc, "devices": []}
n = C.c_int(0)
if rc == "CUDA_SUCCESS":
    cu.call("cuDeviceGetCount", C.byref(n))
for d in range(n.value):
    name = C.create_string_buffer(128); cu.call("cuDeviceGetName", name, 128, d)
    mem = C.c_size_t(); cu.call("cuDeviceTotalMem_v2", C.byref(mem), d)
    sms = C.c_int(); cu.call("cuDeviceGetAttribute", C.byref(sms), 16, d)  # MULTIPROCESSOR_COUNT
    v1 = (C.c_char * 16)(); v2 = (C.c_char * 16)()
    cu.call("cuDeviceGetUuid", v1, d); cu.call("cuDeviceGetUuid_v2", v2, d)
    out["devices"].append([name.value.decode(), mem.value, sms.value, bytes(v1).hex(), bytes(v2).hex()])
print(json.dumps(out))
"""


def hexid(uuid: str) -> str:
    return uuid[4:].replace("-", "")


def cuda_view(env: dict[str, str], visible: str | None) -> dict:
    env = dict(env)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return run_py(env, CUDA_VIEW)  # type: ignore[no-any-return]


def test_cuda_sees_a_mig_device_by_its_uuid_with_its_own_memory_and_sms(mig_env):
    uuids = mig_uuids(mig_env)
    got = cuda_view(mig_env, uuids[1])
    assert got["devices"] == [
        # cuDeviceGetUuid names the GPU, cuDeviceGetUuid_v2 the MIG device.
        ["NVIDIA H100 80GB HBM3 MIG 2g.20gb", 20096 * MIB, 32, hexid(PARENT), hexid(uuids[1])]
    ]
    legacy = cuda_view(mig_env, f"MIG-{PARENT}/13/0")  # MIG-<GPU UUID>/<GI>/<CI>, the pre-R470 form
    assert [d[4] for d in legacy["devices"]] == [hexid(uuids[2])]


def test_cuda_enumerates_one_mig_device_and_never_the_gpu_in_mig_mode(mig_env):
    uuids = mig_uuids(mig_env)
    unset = cuda_view(mig_env, None)
    # The first MIG device stands for GPU 0; GPU 1 is whole.
    assert [(d[0], d[4]) for d in unset["devices"]] == [
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", hexid(uuids[0])),
        ("NVIDIA H100 80GB HBM3", "5c1a0000000040008000000000c90001"),
    ]
    two = cuda_view(mig_env, f"{uuids[2]},{uuids[0]},1")
    assert [d[4] for d in two["devices"]] == [hexid(uuids[2]), "5c1a0000000040008000000000c90001"]
    assert cuda_view(mig_env, "0") == {"init": "CUDA_ERROR_NO_DEVICE", "devices": []}
    assert cuda_view(mig_env, PARENT) == {"init": "CUDA_ERROR_NO_DEVICE", "devices": []}


def test_memory_of_a_mig_device_runs_out_at_its_own_size_and_shows_on_the_gpu(mig_env):
    uuids = mig_uuids(mig_env)
    env = dict(mig_env, CUDA_VISIBLE_DEVICES=uuids[2])  # 1g.10gb: 9984 MiB
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import json, sys
                from cudapy import Driver
                cu = Driver(); cu.init_device(0)
                got = [cu.alloc(9 * (1 << 30))[0], cu.alloc(1 << 30)[0], cu.alloc(512 << 20)[0]]
                print(json.dumps([got, cu.mem_info()]), flush=True)
                sys.stdin.readline()
                """
            ),
        ],
        env=py_env(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        allocs, (free, total) = json.loads(holder.stdout.readline())  # type: ignore[union-attr]
        seen = nvml(
            mig_env,
            """
            n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
            out = [n.nvmlDeviceGetMemoryInfo(h).used]
            for i in range(3):
                out.append(n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)).used)
            print(json.dumps(out))
            """,
        )
    finally:
        holder.communicate("done\n", timeout=30)
    assert allocs == ["CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_SUCCESS"]
    assert total == 9984 * MIB and free == 9984 * MIB - 9 * GIB - 512 * MIB
    held = 9 * GIB + 512 * MIB
    assert seen == [held, 0, 0, held]


def test_the_gpu_lists_the_processes_of_its_mig_devices_with_their_instance_ids(mig_env):
    uuids = mig_uuids(mig_env)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_1_GIB],
        env=py_env(dict(mig_env, CUDA_VISIBLE_DEVICES=uuids[1])),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        listed = nvml(
            mig_env,
            """
            n.nvmlInit()
            out = []
            for i in range(2):
                h = n.nvmlDeviceGetHandleByIndex(i)
                out.append([[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
                            for p in n.nvmlDeviceGetComputeRunningProcesses(h)])
            print(json.dumps(out))
            """,
        )
    finally:
        holder.communicate("done\n", timeout=30)
    assert listed == [[[holder.pid, GIB, 5, 0]], []]  # the 2g.20gb at slices 4-5 is GPU instance 5


HOLD_1_GIB = """
import sys
from cudapy import Driver
cu = Driver(); cu.init_device(0)
assert cu.alloc(1 << 30)[0] == "CUDA_SUCCESS"
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("mig=3g.40gb,2g.20gb,1g.10gb,1g.10gb", "no room for a 1g.10gb instance on GPU 0"),
        ("mig=7g.80gb,1g.10gb", "no room for a 1g.10gb instance on GPU 0"),
        ("mig=5g.50gb", "unknown MIG profile 5g.50gb"),
        ("mig=1g.10gb mem=16GiB", "MIG is simulated for the H100 80GB shape only"),
    ],
)
def test_a_layout_that_cannot_be_is_refused_with_the_reason(tmp_path, native, line, message):
    env = sim_env_in(tmp_path / "bad", native, mem="80GiB", placements=[line])
    proc = subprocess.run(
        [sys.executable, "-c", CUDA_VIEW], env=py_env(env), capture_output=True, text=True, timeout=60
    )
    assert json.loads(proc.stdout)["init"] == "CUDA_ERROR_NO_DEVICE"
    assert message in proc.stderr, proc.stderr


# ctypes callers of the instance calls, as a MIG manager (nvidia-smi mig,
# nvidia-mig-manager) drives them; each script is a process of its own.
ADMIN = """
import ctypes as C, json, sys
lib = C.CDLL("libnvidia-ml.so.1")
assert lib.nvmlInit_v2() == 0
class Placement(C.Structure): _fields_ = [("start", C.c_uint), ("size", C.c_uint)]
class GiInfo(C.Structure):
    _fields_ = [("device", C.c_void_p), ("id", C.c_uint), ("profileId", C.c_uint), ("placement", Placement)]
def gpu(i):
    h = C.c_void_p(); assert lib.nvmlDeviceGetHandleByIndex_v2(i, C.byref(h)) == 0; return h
def gi_by_id(h, gi_id):
    gi = C.c_void_p(); rc = lib.nvmlDeviceGetGpuInstanceById(h, gi_id, C.byref(gi)); return rc, gi
def mig_uuids(h):
    out = []
    for i in range(7):
        m = C.c_void_p()
        if lib.nvmlDeviceGetMigDeviceHandleByIndex(h, i, C.byref(m)) == 0:
            u = C.create_string_buffer(96); assert lib.nvmlDeviceGetUUID(m, u, 96) == 0; out.append(u.value.decode())
    return out
"""

SET_UP = """
h = gpu(1)
status = C.c_int(-1)
out = {"enable": [lib.nvmlDeviceSetMigMode(h, 1, C.byref(status)), status.value]}
cur, pend = C.c_uint(), C.c_uint(); lib.nvmlDeviceGetMigMode(h, C.byref(cur), C.byref(pend))
out["mode"] = [cur.value, pend.value]
gi = C.c_void_p()
out["create"] = lib.nvmlDeviceCreateGpuInstance(h, 9, C.byref(gi))  # 3g.40gb
info = GiInfo(); lib.nvmlGpuInstanceGetInfo(gi, C.byref(info))
out["gi"] = [info.id, info.profileId, info.placement.start, info.placement.size]
out["before_ci"] = mig_uuids(h)
ci = C.c_void_p()
out["ci"] = lib.nvmlGpuInstanceCreateComputeInstance(gi, 2, C.byref(ci))
out["small_ci"] = lib.nvmlGpuInstanceCreateComputeInstance(gi, 0, C.byref(ci))  # a 1-slice CI: not modelled
out["second_ci"] = lib.nvmlGpuInstanceCreateComputeInstance(gi, 2, C.byref(ci))
gi2 = C.c_void_p()
out["taken"] = lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, C.byref(Placement(0, 4)), C.byref(gi2))
out["no_such_place"] = lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, C.byref(Placement(1, 4)), C.byref(gi2))
out["second_gi"] = lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, C.byref(Placement(4, 4)), C.byref(gi2))
left = C.c_uint(9)
lib.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19, C.byref(left))
out["room_for_1g"] = left.value
out["destroy_with_ci"] = lib.nvmlGpuInstanceDestroy(gi)
out["disable_with_gis"] = lib.nvmlDeviceSetMigMode(h, 0, C.byref(status))
out["migs"] = mig_uuids(h)
print(json.dumps(out))
"""

TEAR_DOWN = """
h = gpu(1)
out = {}
rc, gi = gi_by_id(h, 1)
cis = (C.c_void_p * 1)(); n = C.c_uint(0)
assert rc == 0 and lib.nvmlGpuInstanceGetComputeInstances(gi, 2, cis, C.byref(n)) == 0 and n.value == 1
out["destroy_ci"] = lib.nvmlComputeInstanceDestroy(C.c_void_p(cis[0]))
if out["destroy_ci"] == 0:
    out["destroy_gi"] = lib.nvmlGpuInstanceDestroy(gi)
    out["destroy_gi2"] = lib.nvmlGpuInstanceDestroy(gi_by_id(h, 2)[1])
    status = C.c_int(-1)
    out["disable"] = lib.nvmlDeviceSetMigMode(h, 0, C.byref(status))
    out["stale_handle"] = lib.nvmlGpuInstanceGetInfo(gi, C.byref(GiInfo()))
print(json.dumps(out))
"""

IN_USE, INSUFFICIENT_RESOURCES, NOT_SUPPORTED, INVALID_ARGUMENT, NOT_FOUND = 19, 23, 3, 2, 6


def test_instances_made_and_destroyed_at_run_time_are_seen_by_every_process(mig_env):
    got = run_py(mig_env, ADMIN + SET_UP)
    assert got["enable"] == [0, 0] and got["mode"] == [1, 1]
    assert got["create"] == 0 and got["gi"] == [1, 9, 0, 4]
    assert got["before_ci"] == []  # a GPU instance without a compute instance is no MIG device
    assert (got["ci"], got["small_ci"], got["second_ci"]) == (0, NOT_SUPPORTED, INSUFFICIENT_RESOURCES)
    assert (got["taken"], got["no_such_place"], got["second_gi"]) == (INSUFFICIENT_RESOURCES, INVALID_ARGUMENT, 0)
    assert got["room_for_1g"] == 0
    assert (got["destroy_with_ci"], got["disable_with_gis"]) == (IN_USE, IN_USE)
    [made] = got["migs"]
    assert made.startswith("MIG-") and made not in mig_uuids(mig_env)
    # Another process, the CUDA driver: the new MIG device is there, GPU 1 is not.
    seen = cuda_view(mig_env, made)
    assert [(d[0], d[1], d[2]) for d in seen["devices"]] == [("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40448 * MIB, 60)]
    assert cuda_view(mig_env, "1")["init"] == "CUDA_ERROR_NO_DEVICE"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_1_GIB],
        env=py_env(dict(mig_env, CUDA_VISIBLE_DEVICES=made)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        assert run_py(mig_env, ADMIN + TEAR_DOWN) == {"destroy_ci": IN_USE}  # a process uses it
    finally:
        holder.communicate("done\n", timeout=30)
    assert run_py(mig_env, ADMIN + TEAR_DOWN) == {
        "destroy_ci": 0,
        "destroy_gi": 0,
        "destroy_gi2": 0,
        "disable": 0,
        "stale_handle": INVALID_ARGUMENT,
    }
    whole = cuda_view(mig_env, "1")["devices"]
    assert [(d[0], d[1]) for d in whole] == [("NVIDIA H100 80GB HBM3", 80 * GIB)]
    # Made again at the same place, it is another MIG device.
    again = run_py(mig_env, ADMIN + SET_UP)
    assert again["migs"] != [made] and len(again["migs"]) == 1


def test_nvitop_shows_the_mig_devices_under_their_gpu(mig_env):
    """nvitop walks MIG devices as it would on a real H100 (it stops with a
    KeyError where a MIG device answers no BAR1)."""
    proc = subprocess.run(
        [str(NVITOP), "--once"], env=dict(mig_env, COLUMNS="160"), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for line in ("3g.40gb @ GI/CI: 1/0", "2g.20gb @ GI/CI: 5/0", "1g.10gb @ GI/CI:13/0", "9984MiB"):
        assert line in proc.stdout, proc.stdout
    assert proc.stdout.count("Enabled") == 1 and proc.stdout.count("Disabled") == 1
