"""The simulated NVML (libnvidia-ml.so.1) as NVIDIA's own Python binding
(pynvml) and raw ctypes callers see it, and cgpu-sim-stat's view of the same
state. Every program runs in a subprocess on a private simulated machine
(fixture sim_env: 2 GPUs x 16 GiB), since the library is found through
LD_LIBRARY_PATH when it loads.

The tests at the end (`test_with_libcuda_*`) need the simulated libcuda.so.1
to create processes on the GPUs; they skip, naming the missing file, when it
has not been built."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.simrun import PYNVML, py_env, run_py, sim_stat, start_py

GIB = 1 << 30
DEF_FILE = Path(__file__).resolve().parents[2] / "csrc" / "include" / "cgpu" / "nvml_functions.def"
STUB_FILE = Path(__file__).resolve().parents[2] / "csrc" / "simgpu" / "nvml_unmodelled.def"
UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


# Prelude of the ctypes scripts: the library itself, no binding in between.
RAW = """
import ctypes as C, json
lib = C.CDLL("libnvidia-ml.so.1")
lib.nvmlErrorString.restype = C.c_char_p
def handle(i):
    h = C.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(i, C.byref(h)) == 0
    return h
"""


def nvml(sim_env: dict[str, str], body: str) -> object:
    return run_py(sim_env, PYNVML + textwrap.dedent(body))


def raw(sim_env: dict[str, str], body: str) -> object:
    """Run `body` after RAW: ctypes calls straight into the library."""
    return run_py(sim_env, RAW + textwrap.dedent(body))


def machine(tmp_path: Path, sim_env: dict[str, str], lines: list[str]) -> dict[str, str]:
    """sim_env pointed at a fresh machine described by config `lines`."""
    cfg = tmp_path / "machine.conf"
    cfg.write_text("\n".join(lines) + "\n")
    env = dict(sim_env)
    env["CGPU_SIM_CONFIG"] = str(cfg)
    env["CGPU_SIM_STATE"] = str(tmp_path / "machine.state")
    return env


def test_default_machine_inventory(sim_env):
    got = nvml(
        sim_env,
        """
        n.nvmlInit()
        out = {"count": n.nvmlDeviceGetCount(), "driver": n.nvmlSystemGetDriverVersion(),
               "nvml": n.nvmlSystemGetNVMLVersion(), "cuda": n.nvmlSystemGetCudaDriverVersion(),
               "cuda_v2": n.nvmlSystemGetCudaDriverVersion_v2(), "gpus": []}
        for i in range(out["count"]):
            h = n.nvmlDeviceGetHandleByIndex(i)
            pci = n.nvmlDeviceGetPciInfo(h)
            uuid = n.nvmlDeviceGetUUID(h)
            out["gpus"].append({
                "index": n.nvmlDeviceGetIndex(h), "name": n.nvmlDeviceGetName(h), "uuid": uuid,
                "bus_id": pci.busId, "bus_id_legacy": pci.busIdLegacy,
                "pci": [pci.domain, pci.bus, pci.device, pci.pciDeviceId],
                "minor": n.nvmlDeviceGetMinorNumber(h), "cc": n.nvmlDeviceGetCudaComputeCapability(h),
                "multi_gpu_board": n.nvmlDeviceGetMultiGpuBoard(h),
                "by_uuid": addr(n.nvmlDeviceGetHandleByUUID(uuid)) == addr(h),
                "by_bus_id": addr(n.nvmlDeviceGetHandleByPciBusId(pci.busId)) == addr(h),
            })
        n.nvmlShutdown()
        print(json.dumps(out))
    """,
    )
    assert got["count"] == 2
    assert (got["driver"], got["nvml"], got["cuda"], got["cuda_v2"]) == ("580.65.06", "13.580.65.06", 13000, 13000)
    gpus = got["gpus"]
    assert [g["index"] for g in gpus] == [0, 1]
    assert [g["minor"] for g in gpus] == [0, 1]
    assert all(g["name"] == "NVIDIA H100 80GB HBM3" for g in gpus)
    assert all(UUID_RE.match(g["uuid"]) for g in gpus), gpus
    assert gpus[0]["uuid"] != gpus[1]["uuid"]
    assert [g["bus_id"] for g in gpus] == ["00000000:18:00.0", "00000000:28:00.0"]
    assert [g["bus_id_legacy"] for g in gpus] == ["0000:18:00.0", "0000:28:00.0"]
    assert [g["pci"] for g in gpus] == [[0, 0x18, 0, 0x233010DE], [0, 0x28, 0, 0x233010DE]]
    assert all(g["cc"] == [9, 0] and g["multi_gpu_board"] == 0 for g in gpus)
    assert all(g["by_uuid"] and g["by_bus_id"] for g in gpus)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_memory_info_at_start(sim_env, version):
    call = {"v1": "n.nvmlDeviceGetMemoryInfo(h)", "v2": "n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)"}[
        version
    ]
    got = nvml(
        sim_env,
        f"""
        n.nvmlInit()
        out = []
        for i in range(2):
            h = n.nvmlDeviceGetHandleByIndex(i)
            m = {call}
            out.append([m.total, m.free, m.used, getattr(m, "reserved", 0)])
        print(json.dumps(out))
    """,
    )
    assert got == [[16 * GIB, 16 * GIB, 0, 0]] * 2


def test_memory_info_v2_checks_the_struct_version(sim_env):
    got = nvml(
        sim_env,
        """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        print(json.dumps(err(lambda: n.nvmlDeviceGetMemoryInfo(h, version=0x01000028))))
    """,
    )
    assert got == "NVMLError_ArgumentVersionMismatch"


def test_configured_identity_is_reported(tmp_path, sim_env):
    env = machine(
        tmp_path,
        sim_env,
        [
            "driver_version=12080 driver_version_string=570.86.15",
            'gpu name="NVIDIA A100-SXM4-40GB" mem=40GiB sms=108 cc=8.0 '
            "uuid=GPU-11111111-2222-3333-4444-555555555555 pci=00000001:3B:00.0",
        ],
    )
    got = nvml(
        env,
        """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0); pci = n.nvmlDeviceGetPciInfo(h)
        print(json.dumps([n.nvmlDeviceGetCount(), n.nvmlDeviceGetName(h), n.nvmlDeviceGetUUID(h),
                          pci.busId, n.nvmlDeviceGetCudaComputeCapability(h),
                          n.nvmlDeviceGetMemoryInfo(h).total, n.nvmlSystemGetCudaDriverVersion(),
                          n.nvmlSystemGetNVMLVersion(),
                          addr(n.nvmlDeviceGetHandleByPciBusId("00000001:3b:00.0")) == addr(h)]))
    """,
    )
    assert got == [
        1,
        "NVIDIA A100-SXM4-40GB",
        "GPU-11111111-2222-3333-4444-555555555555",
        "00000001:3B:00.0",
        [8, 0],
        40 * GIB,
        12080,
        "12.570.86.15",
        True,
    ]


@pytest.mark.parametrize(
    "bus_id",
    ["00000000:28:00.0", "0000:28:00.0", "28:00.0", "0000:28:00"],
    ids=["nvml", "legacy", "bus-device-function", "domain-bus-device"],
)
def test_handle_by_pci_bus_id_accepts_the_usual_spellings(sim_env, bus_id):
    got = nvml(
        sim_env,
        f"""
        n.nvmlInit()
        print(json.dumps(n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId({bus_id!r}))))
    """,
    )
    assert got == 1


GPU0 = "n.nvmlDeviceGetHandleByIndex(0)"
ERRORS = [
    ("index past the last GPU", "n.nvmlDeviceGetHandleByIndex(2)", "NVMLError_InvalidArgument"),
    ("unknown uuid", "n.nvmlDeviceGetHandleByUUID('GPU-00000000-0000-0000-0000-000000000000')", "NVMLError_NotFound"),
    ("unknown bus id", "n.nvmlDeviceGetHandleByPciBusId('00000000:99:00.0')", "NVMLError_NotFound"),
    ("malformed bus id", "n.nvmlDeviceGetHandleByPciBusId('not-a-bus-id')", "NVMLError_InvalidArgument"),
    ("bus id of function 1", "n.nvmlDeviceGetHandleByPciBusId('0000:18:00.1')", "NVMLError_NotFound"),
    ("link past the last", f"n.nvmlDeviceGetNvLinkState({GPU0}, 36)", "NVMLError_InvalidArgument"),
    ("nvlink on a GPU without", f"n.nvmlDeviceGetNvLinkState({GPU0}, 0)", "NVMLError_NotSupported"),
    (
        "p2p index unknown",
        "n.nvmlDeviceGetP2PStatus(*[n.nvmlDeviceGetHandleByIndex(i) for i in (0, 1)], 5)",
        "NVMLError_InvalidArgument",
    ),
    ("no process samples", f"n.nvmlDeviceGetProcessUtilization({GPU0}, 0)", "NVMLError_NotFound"),
    ("forged handle", "n.nvmlDeviceGetName(C.cast(C.c_void_p(4096), n.c_nvmlDevice_t))", "NVMLError_InvalidArgument"),
]


@pytest.mark.parametrize(("case", "call", "expected"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_are_nvmls_own(sim_env, case, call, expected):
    got = nvml(
        sim_env,
        f"""
        n.nvmlInit()
        print(json.dumps(err(lambda: {call})))
    """,
    )
    assert got == expected, case


def test_init_is_reference_counted(sim_env):
    got = nvml(
        sim_env,
        """
        n.nvmlInit(); n.nvmlInit()
        out = [err(n.nvmlShutdown), err(n.nvmlDeviceGetCount), err(n.nvmlShutdown), err(n.nvmlDeviceGetCount),
               err(lambda: n.nvmlDeviceGetHandleByIndex(0)), err(n.nvmlSystemGetDriverVersion)]
        n.nvmlInit(); out.append(err(n.nvmlDeviceGetCount))
        print(json.dumps(out))
    """,
    )
    assert got == [
        "ok",
        "ok",
        "ok",
        "NVMLError_Uninitialized",
        "NVMLError_Uninitialized",
        "NVMLError_Uninitialized",
        "ok",
    ]


def test_raw_calls_before_init_and_after_last_shutdown(sim_env):
    got = raw(
        sim_env,
        """
        count, buf = C.c_uint(99), C.create_string_buffer(80)
        out = [lib.nvmlDeviceGetCount_v2(C.byref(count)), lib.nvmlShutdown(), lib.nvmlSystemGetDriverVersion(buf, 80)]
        out += [lib.nvmlInit_v2(), lib.nvmlDeviceGetCount(C.byref(count)), count.value]
        out += [lib.nvmlShutdown(), lib.nvmlShutdown(), lib.nvmlErrorString(1).decode()]
        print(json.dumps(out))
    """,
    )
    assert got == [1, 1, 1, 0, 0, 2, 0, 1, "Uninitialized"]


def test_version_queries_need_no_init(sim_env):
    # As documented for real NVML: they list no NVML_ERROR_UNINITIALIZED.
    got = raw(
        sim_env,
        """
        cuda, cuda2, buf = C.c_int(), C.c_int(), C.create_string_buffer(80)
        out = [lib.nvmlSystemGetCudaDriverVersion(C.byref(cuda)), lib.nvmlSystemGetCudaDriverVersion_v2(C.byref(cuda2)),
               lib.nvmlSystemGetNVMLVersion(buf, 80)]
        print(json.dumps(out + [cuda.value, cuda2.value, buf.value.decode()]))
    """,
    )
    assert got == [0, 0, 0, 13000, 13000, "13.580.65.06"]


# (case, call, expected result, expected count or None); `count` is a c_uint
# set to 0 before each call.
SIZES = [
    ("name buffer too small", "lib.nvmlDeviceGetName(handle(0), C.create_string_buffer(8), 8)", 7, None),
    ("uuid buffer too small", "lib.nvmlDeviceGetUUID(handle(0), C.create_string_buffer(40), 40)", 7, None),
    ("driver version too small", "lib.nvmlSystemGetDriverVersion(C.create_string_buffer(4), 4)", 7, None),
    ("no processes, size query", "lib.nvmlDeviceGetComputeRunningProcesses_v3(handle(0), C.byref(count), None)", 0, 0),
    ("no graphics processes", "lib.nvmlDeviceGetGraphicsRunningProcesses_v3(handle(1), C.byref(count), None)", 0, 0),
    ("NULL count", "lib.nvmlDeviceGetComputeRunningProcesses_v2(handle(0), None, None)", 2, None),
    ("NULL memory struct", "lib.nvmlDeviceGetMemoryInfo(handle(0), None)", 2, None),
    ("NULL device count", "lib.nvmlDeviceGetCount_v2(None)", 2, None),
    ("NULL name buffer", "lib.nvmlDeviceGetName(handle(0), None, 96)", 2, None),
    ("NULL uuid", "lib.nvmlDeviceGetHandleByUUID(None, C.byref(C.c_void_p()))", 2, None),
]


@pytest.mark.parametrize(("case", "call", "rc", "count"), SIZES, ids=[s[0] for s in SIZES])
def test_buffers_and_pointers(sim_env, case, call, rc, count):
    got = raw(
        sim_env,
        f"""
        assert lib.nvmlInit_v2() == 0
        count = C.c_uint(0)
        print(json.dumps([{call}, count.value]))
    """,
    )
    assert got[0] == rc, case
    if count is not None:
        assert got[1] == count, case


def test_legacy_pci_info_leaves_the_new_bus_id_alone(sim_env):
    # Old callers pass the 52-byte pre-9.0 struct: bytes past pciSubSystemId
    # are theirs (reserved words), not ours to write.
    got = raw(
        sim_env,
        """
        assert lib.nvmlInit_v2() == 0
        out = []
        for fn in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3"):
            buf = (C.c_ubyte * 68)(*([0xAB] * 68))
            rc = getattr(lib, fn)(handle(1), buf)
            out.append([rc, bytes(buf[:16]).split(b"\\0")[0].decode(), bytes(buf[36:68]).split(b"\\0")[0].hex()])
        print(json.dumps(out))
    """,
    )
    untouched = "ab" * 32
    assert got == [
        [0, "0000:28:00.0", untouched],
        [0, "0000:28:00.0", untouched],
        [0, "0000:28:00.0", b"00000000:28:00.0".hex()],
    ]


NVLINK_MACHINE = [
    # GPU 0 <-> 1 and 0 <-> 2; GPU 2 names no link itself (a link has two
    # ends, either side may name it); GPU 3 has none.
    'gpu name="NVIDIA H100 80GB HBM3" mem=16GiB pci=00000000:18:00.0 nvlink=1,2',
    'gpu name="NVIDIA H100 80GB HBM3" mem=16GiB pci=00000000:2A:00.0 nvlink=0',
    'gpu name="NVIDIA H100 80GB HBM3" mem=16GiB pci=00000000:3A:00.0',
    'gpu name="NVIDIA H100 80GB HBM3" mem=16GiB pci=00000000:5D:00.0',
]


def test_nvlink_state_remote_and_p2p(tmp_path, sim_env):
    env = machine(tmp_path, sim_env, NVLINK_MACHINE)
    got = nvml(
        env,
        """
        n.nvmlInit(); h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
        def state(d, l):
            try:
                return n.nvmlDeviceGetNvLinkState(h[d], l)
            except n.NVMLError as e:
                return type(e).__name__
        out = {
            "state": [[state(d, l) for l in range(3)] for d in range(4)],
            "remote": [n.nvmlDeviceGetNvLinkRemotePciInfo(h[0], l).busId for l in (0, 1)],
            "remote_down": err(lambda: n.nvmlDeviceGetNvLinkRemotePciInfo(h[1], 1)),
            "p2p": {f"{a}{b}": n.nvmlDeviceGetP2PStatus(h[a], h[b], n.NVML_P2P_CAPS_INDEX_NVLINK)
                    for a, b in [(0, 1), (1, 0), (0, 2), (1, 2), (0, 3), (3, 3)]},
            # pynvml's NVML_P2P_CAPS_INDEX_READ is the tuple (0,) (a stray comma)
            "p2p_read_01": n.nvmlDeviceGetP2PStatus(h[0], h[1], 0),
            "p2p_pci_01": n.nvmlDeviceGetP2PStatus(h[0], h[1], n.NVML_P2P_CAPS_INDEX_PCI),
            "cap": [n.nvmlDeviceGetNvLinkCapability(h[0], l, n.NVML_NVLINK_CAP_P2P_SUPPORTED) for l in range(3)],
            "topo": [n.nvmlDeviceGetTopologyCommonAncestor(h[0], h[d]) for d in (0, 1)],
        }
        print(json.dumps(out))
    """,
    )
    assert got["state"] == [[1, 1, 0], [1, 0, 0], [1, 0, 0], ["NVMLError_NotSupported"] * 3]
    assert got["remote"] == ["00000000:2A:00.0", "00000000:3A:00.0"]
    assert got["remote_down"] == "NVMLError_NotSupported"
    ok, no = 0, 5  # NVML_P2P_STATUS_OK, NVML_P2P_STATUS_NOT_SUPPORTED
    assert got["p2p"] == {"01": ok, "10": ok, "02": ok, "12": no, "03": no, "33": no}
    assert (got["p2p_read_01"], got["p2p_pci_01"]) == (ok, no)
    assert got["cap"] == [1, 1, 0]
    assert got["topo"] == [0, 50]  # NVML_TOPOLOGY_INTERNAL, NVML_TOPOLOGY_SYSTEM


TREE_MACHINE = [
    # GPUs 0 and 1 behind one PCIe switch, 2 beside them under the same host
    # bridge, 3 on the same socket elsewhere, 4 on the other socket; 0-1 by
    # two NVLinks, 0-4 by one.
    "gpu mem=16GiB pci=00000000:18:00.0 switch=0 bridge=0 socket=0 nvlink=1*2,4",
    "gpu mem=16GiB pci=00000000:2A:00.0 switch=0 bridge=0 socket=0",
    "gpu mem=16GiB pci=00000000:3A:00.0 bridge=0 socket=0",
    "gpu mem=16GiB pci=00000000:5D:00.0 socket=0",
    "gpu mem=16GiB pci=00000000:9A:00.0 socket=1",
]


def test_the_pcie_tree_and_link_counts(tmp_path, sim_env):
    env = machine(tmp_path, sim_env, TREE_MACHINE)
    got = nvml(
        env,
        """
        n.nvmlInit(); h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(5)]
        index = {n.nvmlDeviceGetPciInfo(x).busId: i for i, x in enumerate(h)}
        out = {
            "levels": [n.nvmlDeviceGetTopologyCommonAncestor(h[0], h[d]) for d in range(5)],
            "nearest": {lvl: sorted(index[n.nvmlDeviceGetPciInfo(x).busId]
                                    for x in n.nvmlDeviceGetTopologyNearestGpus(h[0], lvl))
                        for lvl in (0, 10, 30, 40, 50)},
            "links": [n.nvmlDeviceGetNvLinkRemotePciInfo(h[0], l).busId for l in range(3)],
            "link_3": n.nvmlDeviceGetNvLinkState(h[0], 3),
            "bad_level": err(lambda: n.nvmlDeviceGetTopologyNearestGpus(h[0], 60)),
        }
        print(json.dumps(out))
    """,
    )
    assert got["levels"] == [0, 10, 30, 40, 50]  # INTERNAL, SINGLE, HOSTBRIDGE, NODE, SYSTEM
    assert got["nearest"] == {"0": [], "10": [1], "30": [1, 2], "40": [1, 2, 3], "50": [1, 2, 3, 4]}
    assert got["links"] == ["00000000:2A:00.0", "00000000:2A:00.0", "00000000:9A:00.0"]
    assert got["link_3"] == 0  # a link the GPU has, down (NVML_FEATURE_DISABLED)
    assert got["bad_level"] == "NVMLError_InvalidArgument"


def test_an_nvswitch_fabric_joins_its_gpus(tmp_path, sim_env):
    """GPUs 0 and 1 have 4 links each into the fabric; GPU 2 none."""
    lines = [
        f"gpu mem=16GiB pci=00000000:{bus}:00.0{extra}"
        for bus, extra in (("18", " nvswitch=4"), ("2A", " nvswitch=4"), ("3A", ""))
    ]
    env = machine(tmp_path, sim_env, lines)
    got = nvml(
        env,
        """
        n.nvmlInit(); h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
        out = {
            "types": [n.nvmlDeviceGetNvLinkRemoteDeviceType(h[0], l) for l in range(4)],
            "remote": sorted({n.nvmlDeviceGetNvLinkRemotePciInfo(h[0], l).busId for l in range(4)}),
            "state_4": n.nvmlDeviceGetNvLinkState(h[0], 4),
            "p2p": [n.nvmlDeviceGetP2PStatus(h[0], h[d], n.NVML_P2P_CAPS_INDEX_NVLINK) for d in (1, 2)],
            "no_link": err(lambda: n.nvmlDeviceGetNvLinkRemoteDeviceType(h[2], 0)),
        }
        print(json.dumps(out))
    """,
    )
    assert got["types"] == [2, 2, 2, 2]  # NVML_NVLINK_DEVICE_TYPE_SWITCH
    assert got["remote"] == [f"00000000:C{k}:00.0" for k in (1, 2, 3, 4)]  # four switches, none a GPU
    assert got["state_4"] == 0  # past its links: down
    assert got["p2p"] == [0, 5]  # OK through the fabric; NOT_SUPPORTED to a GPU outside it
    assert got["no_link"] == "NVMLError_NotSupported"


def test_init_fails_with_driver_not_loaded_on_a_bad_config(tmp_path, sim_env):
    env = dict(sim_env, CGPU_SIM_CONFIG=str(tmp_path / "missing.conf"))
    script = "import pynvml as n\ntry:\n    n.nvmlInit()\nexcept n.NVMLError as e:\n    print(type(e).__name__)"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "NVMLError_DriverNotLoaded"
    assert "missing.conf" in proc.stderr


def test_exported_symbols_are_the_def_list(native):
    listed = set(re.findall(r"^NVML_FN\((\w+)", DEF_FILE.read_text(), re.M))
    listed |= set(re.findall(r"^NVML_STUB\((\w+)", STUB_FILE.read_text(), re.M))
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", str(native / "sim" / "libnvidia-ml.so.1")],
        capture_output=True,
        text=True,
        check=True,
    )
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert exported == listed


def test_sim_stat_shape_matches_nvml(native, sim_env):
    stat = sim_stat(native, sim_env)
    uuids = nvml(
        sim_env,
        """
        n.nvmlInit()
        print(json.dumps([n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]))
    """,
    )
    assert set(stat) == {"gpus", "procs", "now_ns"}
    assert [(g["index"], g["uuid"]) for g in stat["gpus"]] == list(enumerate(uuids))
    for g in stat["gpus"]:
        assert set(g) == {"index", "uuid", "name", "total", "used", "busy_total_ns", "lost", "xids"}
        assert (g["name"], g["total"], g["used"], g["busy_total_ns"]) == ("NVIDIA H100 80GB HBM3", 16 * GIB, 0, 0)
    assert stat["procs"] == []
    assert isinstance(stat["now_ns"], int) and stat["now_ns"] > 0
    busy = sim_stat(native, sim_env, "--busy", "1", "0", str(stat["now_ns"]))
    assert busy == {"busy_ns": 0, "per_pid": {}, "complete": True}


STAT_ERRORS = [
    ("state dir missing", [], {"CGPU_SIM_STATE": "/nonexistent/dir/state"}, 1),
    ("config unreadable", [], {"CGPU_SIM_CONFIG": "/nonexistent/sim.conf"}, 1),
    ("no such gpu", ["--busy", "2", "0", "1"], {}, 2),
    ("bad number", ["--busy", "0", "x", "1"], {}, 2),
    ("missing numbers", ["--busy", "0"], {}, 2),
    ("unknown option", ["--bogus"], {}, 2),
]


@pytest.mark.parametrize(("case", "args", "env_change", "code"), STAT_ERRORS, ids=[e[0] for e in STAT_ERRORS])
def test_sim_stat_errors_are_one_line(native, sim_env, case, args, env_change, code):
    proc = subprocess.run(
        [str(native / "bin" / "cgpu-sim-stat"), *args],
        env={**sim_env, **env_change},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (proc.returncode, proc.stdout) == (code, ""), case
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_sim_stat_refuses_a_state_made_for_another_config(tmp_path, native, sim_env):
    sim_stat(native, sim_env)  # creates the state for the 2-GPU config
    other = machine(tmp_path, sim_env, ["gpu mem=8GiB"])
    other["CGPU_SIM_STATE"] = sim_env["CGPU_SIM_STATE"]
    proc = subprocess.run(
        [str(native / "bin" / "cgpu-sim-stat")], env=other, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 1 and "another configuration" in proc.stderr


# --- Processes on the GPUs: these need the simulated libcuda.so.1. ---------


@pytest.fixture
def libcuda(native: Path) -> Path:
    path = native / "sim" / "libcuda.so.1"
    if not path.exists():
        pytest.skip(f"{path} is not built: the process views of NVML need the simulated libcuda")
    return path


HOLDER = """
import json, os, sys
from cudapy import Driver
cu = Driver(); cu.init_device(1)
assert cu.alloc({size})[0] == "CUDA_SUCCESS"
print(json.dumps(os.getpid()), flush=True)
sys.stdin.readline()
"""


def test_with_libcuda_processes_memory_and_reaping(libcuda, native, sim_env):
    holder = start_py(sim_env, HOLDER.format(size=3 * GIB))
    try:
        pid = json.loads(holder.stdout.readline())
        seen = nvml(
            sim_env,
            """
            n.nvmlInit(); h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
            procs = [[[p.pid, p.usedGpuMemory, p.gpuInstanceId] for p in n.nvmlDeviceGetComputeRunningProcesses(d)]
                     for d in h]
            print(json.dumps({"procs": procs, "used": [n.nvmlDeviceGetMemoryInfo(d).used for d in h],
                              "mem_util": n.nvmlDeviceGetUtilizationRates(h[1]).memory}))
        """,
        )
        by_ctypes = raw(
            sim_env,
            """
            lib.nvmlInit_v2()
            count = C.c_uint(0)
            first = lib.nvmlDeviceGetComputeRunningProcesses(handle(1), C.byref(count), None)
            needed = count.value
            infos = (C.c_ubyte * (16 * needed))()  # nvmlProcessInfo_v1_t: pid, pad, usedGpuMemory
            second = lib.nvmlDeviceGetComputeRunningProcesses(handle(1), C.byref(count), infos)
            print(json.dumps([first, needed, second, count.value, int.from_bytes(bytes(infos[0:4]), "little"),
                              int.from_bytes(bytes(infos[8:16]), "little")]))
        """,
        )
        stat = sim_stat(native, sim_env)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert seen["procs"] == [[], [[pid, 3 * GIB, 0xFFFFFFFF]]]
    assert seen["used"] == [0, 3 * GIB]
    assert seen["mem_util"] == 19  # 3/16, rounded
    assert by_ctypes == [7, 1, 0, 1, pid, 3 * GIB]  # INSUFFICIENT_SIZE, then SUCCESS
    assert [(p["pid"], p["alive"], p["used"]) for p in stat["procs"]] == [(pid, True, [0, 3 * GIB])]
    assert stat["gpus"][1]["used"] == 3 * GIB
    # Killed: the next query finds the process gone and its memory free.
    after = nvml(
        sim_env,
        """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(1)
        print(json.dumps([n.nvmlDeviceGetComputeRunningProcesses(h), n.nvmlDeviceGetMemoryInfo(h).used]))
    """,
    )
    assert after == [[], 0]
    assert sim_stat(native, sim_env)["procs"] == []


SPINNER = """
import json, os, sys, time
from cudapy import Driver
cu = Driver(); cu.init_device(0); fn = cu.spin_function()
end = time.monotonic() + 0.6
while time.monotonic() < end:
    cu.launch_spin(fn, 1_000_000)
cu.call("cuCtxSynchronize")
print(json.dumps(os.getpid()), flush=True)
sys.stdin.readline()
"""


# Waits on stdin so that it samples right after the kernels end, not after an
# interpreter start; notes CLOCK_MONOTONIC (the state's clock) around the
# samples so that the test can ask cgpu-sim-stat about the same second.
UTIL_READER = (
    PYNVML
    + """
import sys, time
n.nvmlInit(); h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
sys.stdin.readline()
before = time.monotonic_ns()
util = [n.nvmlDeviceGetUtilizationRates(d).gpu for d in h]
samples = [[s.pid, s.smUtil, s.timeStamp] for s in n.nvmlDeviceGetProcessUtilization(h[0], 0)]
after = time.monotonic_ns()
later = err(lambda: n.nvmlDeviceGetProcessUtilization(h[0], samples[0][2] + 1))
print(json.dumps({"util": util, "samples": samples, "later": later, "now_us": int(time.time() * 1e6),
                  "before": before, "after": after}))
"""
)


def test_with_libcuda_utilization_follows_kernels(libcuda, native, sim_env):
    t0 = sim_stat(native, sim_env)["now_ns"]
    reader = start_py(sim_env, UTIL_READER)
    spinner = start_py(sim_env, SPINNER)
    try:
        pid = json.loads(spinner.stdout.readline())
        out, errs = reader.communicate("go\n", timeout=60)
        assert reader.returncode == 0, errs
        got = json.loads(out.strip().splitlines()[-1])
        stat = sim_stat(native, sim_env)
        busy = sim_stat(native, sim_env, "--busy", "0", str(t0), str(stat["now_ns"]))
        # The device's busy share of the second before each sample, bounded by
        # the two ends of the sampling.
        shares = [
            sim_stat(native, sim_env, "--busy", "0", str(t - 1_000_000_000), str(t))["busy_ns"] / 1e7
            for t in (got["before"], got["after"])
        ]
    finally:
        spinner.send_signal(signal.SIGKILL)
        spinner.wait(timeout=30)
        reader.kill()
        reader.wait(timeout=30)
    # About 0.6 s of kernels ended just before the samples.
    lo, hi = min(shares) - 1, max(shares) + 1
    assert lo <= got["util"][0] <= hi and got["util"][0] > 0 and got["util"][1] == 0, (got["util"], shares)
    [(sample_pid, sm, stamp)] = got["samples"]
    assert sample_pid == pid and lo <= sm <= hi, (sm, shares)
    assert 0 <= got["now_us"] - stamp < 10_000_000  # microseconds of the wall clock
    assert got["later"] == "NVMLError_NotFound"  # nothing newer than the last sample
    [proc] = stat["procs"]
    assert proc["pid"] == pid and proc["busy_ns"][0] >= 300_000_000
    assert busy["complete"] and busy["busy_ns"] == proc["busy_ns"][0]
    assert busy["per_pid"] == {str(proc["pid"]): busy["busy_ns"]}


# --- Pid namespaces: NVML reports each process as the caller's pid namespace
# sees it, as a real driver does (a host caller gets host pids; a process not
# visible from the caller's namespace is left out). Tenants run under
# `unshare -p -f --mount-proc`, where they are pid 1. ---------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: unshare -p makes a pid namespace")

# Holds `size` bytes on GPU `gpu`, optionally runs `spin_s` seconds of
# kernels on it, then (optionally) drops its POSIX locks on the state file
# by closing a second descriptor of it, reports its own pid and waits.
NS_TENANT = """
import json, os, sys, time
from cudapy import Driver
size, gpu, spin_s, drop = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "drop"
cu = Driver(); cu.init_device(gpu)
assert cu.alloc(size)[0] == "CUDA_SUCCESS"
if spin_s:
    fn = cu.spin_function(); end = time.monotonic() + spin_s
    while time.monotonic() < end:
        cu.launch_spin(fn, 1_000_000)
    cu.call("cuCtxSynchronize")
if drop:
    os.close(os.open(os.environ["CGPU_SIM_STATE"], os.O_RDONLY))
print(json.dumps(os.getpid()), flush=True)
sys.stdin.readline()
"""


class NsTenant:
    """A tenant in a pid namespace of its own: `ns_pid` as it sees itself,
    `host_pid` as the host does."""

    def __init__(self, sim_env: dict[str, str], size: int, gpu: int = 1, spin_s: float = 0, drop: bool = False):
        self.proc = subprocess.Popen(
            [
                "unshare",
                "-p",
                "-f",
                "--mount-proc",
                sys.executable,
                "-c",
                NS_TENANT,
                str(size),
                str(gpu),
                str(spin_s),
                "drop" if drop else "keep",
            ],
            env=py_env(sim_env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def started(self) -> NsTenant:
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.ns_pid = json.loads(line)
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        [self.host_pid] = [int(c) for c in children]
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            # pid 1 of its namespace: the namespace goes with it (unshare, if it never started).
            os.kill(getattr(self, "host_pid", self.proc.pid), signal.SIGKILL)
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def ns_tenants(sim_env: dict[str, str], *specs: dict) -> Iterator[list[NsTenant]]:
    tenants = [NsTenant(sim_env, **spec) for spec in specs]
    try:
        yield [t.started() for t in tenants]
    finally:
        for t in tenants:
            t.kill()


LIST_PROCS = """
n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex({gpu})
print(json.dumps({{"procs": sorted([p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)),
                  "used": n.nvmlDeviceGetMemoryInfo(h).used}}))
"""


def nvml_in(sim_env: dict[str, str], prefix: list[str], body: str) -> object:
    """A pynvml script run under `prefix` (unshare, nsenter)."""
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", PYNVML + textwrap.dedent(body)],
        env=py_env(sim_env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_root
def test_pids_are_those_of_the_callers_namespace(libcuda, native, sim_env):
    with ns_tenants(sim_env, {"size": GIB}) as [t]:
        host = nvml(sim_env, LIST_PROCS.format(gpu=1))
        other = nvml_in(sim_env, ["unshare", "-p", "-f", "--mount-proc"], LIST_PROCS.format(gpu=1))
        inside = nvml_in(sim_env, ["nsenter", "-p", "-t", str(t.host_pid)], LIST_PROCS.format(gpu=1))
        [stat] = sim_stat(native, sim_env)["procs"]
    assert t.ns_pid == 1 and t.host_pid != 1
    assert host == {"procs": [[t.host_pid, GIB]], "used": GIB}
    # Another namespace cannot see the tenant; the device's memory is still used.
    assert other == {"procs": [], "used": GIB}
    # Its own namespace sees it as it sees itself.
    assert inside == {"procs": [[1, GIB]], "used": GIB}
    assert (stat["pid"], stat["ns_pid"], stat["used"]) == (t.host_pid, 1, [0, GIB])


@needs_root
def test_same_pid_in_two_namespaces_is_two_processes(libcuda, native, sim_env):
    with ns_tenants(sim_env, {"size": GIB, "gpu": 0, "spin_s": 0.8}, {"size": 2 * GIB, "gpu": 0, "spin_s": 0.4}) as [
        a,
        b,
    ]:
        got = nvml(
            sim_env,
            """
            n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
            procs = sorted([p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h))
            before = time.monotonic_ns()
            samples = sorted([s.pid, s.smUtil] for s in n.nvmlDeviceGetProcessUtilization(h, 0))
            after = time.monotonic_ns()
            print(json.dumps({"procs": procs, "samples": samples, "before": before, "after": after}))
        """,
        )
        # Each one's busy share of the second before each end of the sampling.
        shares = [
            sim_stat(native, sim_env, "--busy", "0", str(t - 1_000_000_000), str(t))["per_pid"]
            for t in (got["before"], got["after"])
        ]
    assert a.ns_pid == b.ns_pid == 1
    assert got["procs"] == sorted([[a.host_pid, GIB], [b.host_pid, 2 * GIB]])
    assert [pid for pid, _ in got["samples"]] == sorted([a.host_pid, b.host_pid])
    for pid, sm in got["samples"]:
        seen = [s.get(str(pid), 0) / 1e7 for s in shares]
        assert min(seen) - 1 <= sm <= max(seen) + 1 and sm > 0, (pid, sm, seen)
    # Its own kernels only: a ran twice as long as b.
    assert got["samples"][0][1] != got["samples"][1][1]


@needs_root
def test_killed_namespaced_process_memory_returns(libcuda, native, sim_env):
    with ns_tenants(sim_env, {"size": 3 * GIB}) as [t]:
        before = nvml(sim_env, LIST_PROCS.format(gpu=1))
        t.kill()
        after = nvml(sim_env, LIST_PROCS.format(gpu=1))
    assert before == {"procs": [[t.host_pid, 3 * GIB]], "used": 3 * GIB}
    assert after == {"procs": [], "used": 0}
    assert sim_stat(native, sim_env)["procs"] == []


def _posix_lock_holders() -> set[int]:
    return {int(line.split()[4]) for line in Path("/proc/locks").read_text().splitlines() if line.split()[1] == "POSIX"}


@needs_root
def test_lost_pid_lock_falls_back_to_proc(libcuda, native, sim_env):
    with ns_tenants(sim_env, {"size": GIB}, {"size": 2 * GIB, "drop": True}) as [keeps, dropped]:
        holders = _posix_lock_holders()
        host = nvml(sim_env, LIST_PROCS.format(gpu=1))
        other = nvml_in(sim_env, ["unshare", "-p", "-f", "--mount-proc"], LIST_PROCS.format(gpu=1))
        stat = sim_stat(native, sim_env)["procs"]
    # Closing a descriptor of the state file dropped the tenant's pid lock.
    assert keeps.host_pid in holders and dropped.host_pid not in holders
    assert host == {"procs": sorted([[keeps.host_pid, GIB], [dropped.host_pid, 2 * GIB]]), "used": 3 * GIB}
    assert other == {"procs": [], "used": 3 * GIB}
    assert sorted(p["pid"] for p in stat) == sorted([keeps.host_pid, dropped.host_pid])


# --- context_mib: the driver memory of a process's first context on a GPU. --

CONTEXTS = """
import ctypes as C, json, os, sys
from cudapy import Driver
cu = Driver(); cu.init_device(0)
again, other, own = C.c_void_p(), C.c_void_p(), C.c_void_p()
cu.call("cuDevicePrimaryCtxRetain", C.byref(again), 0)  # the same context again: no new charge
cu.call("cuCtxCreate_v2", C.byref(own), 0, 0)  # another context on GPU 0: the process pays once per GPU
cu.call("cuCtxPopCurrent_v2", C.byref(own))
cu.call("cuDevicePrimaryCtxRetain", C.byref(other), 1)
assert cu.alloc({size})[0] == "CUDA_SUCCESS"
print(json.dumps([os.getpid(), cu.mem_info()]), flush=True)
sys.stdin.readline()
"""


def test_context_mib_is_charged_once_per_process_and_gpu(libcuda, tmp_path, native, sim_env):
    mib = 1 << 20
    env = machine(tmp_path, sim_env, ["context_mib=300", "gpu mem=16GiB", "gpu mem=16GiB"])
    tenants, seen = [], []
    try:
        for size in (GIB, 2 * GIB):  # one after the other: b's free memory counts all of a
            tenants.append(start_py(env, CONTEXTS.format(size=size)))
            seen.append(json.loads(tenants[-1].stdout.readline()))
        got = nvml(
            env,
            """
            n.nvmlInit(); h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
            print(json.dumps([[sorted([p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(d)),
                               n.nvmlDeviceGetMemoryInfo(d).used] for d in h]))
        """,
        )
        stat = sim_stat(native, env)
    finally:
        for t in tenants:
            t.kill()
            t.wait(timeout=30)
    (a, a_mem), (b, b_mem) = seen
    gpu0 = sorted([[a, GIB + 300 * mib], [b, 2 * GIB + 300 * mib]])
    assert got == [[gpu0, 3 * GIB + 600 * mib], [sorted([[a, 300 * mib], [b, 300 * mib]]), 600 * mib]]
    assert stat["gpus"][0]["used"] == 3 * GIB + 600 * mib
    # cuMemGetInfo's free, as a real driver's, counts the contexts.
    assert a_mem == [16 * GIB - GIB - 300 * mib, 16 * GIB]
    assert b_mem == [16 * GIB - 3 * GIB - 600 * mib, 16 * GIB]


def test_a_context_that_does_not_fit_fails(libcuda, tmp_path, sim_env):
    env = machine(tmp_path, sim_env, ["context_mib=2048", "gpu mem=1GiB"])
    got = run_py(
        env,
        """
        import ctypes as C, json
        from cudapy import Driver
        cu = Driver(); cu.call("cuInit", 0); ctx = C.c_void_p()
        print(json.dumps([cu.rc("cuDevicePrimaryCtxRetain", C.byref(ctx), 0),
                          cu.rc("cuCtxCreate_v2", C.byref(ctx), 0, 0)]))
    """,
    )
    assert got == ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_OUT_OF_MEMORY"]


def test_context_mib_must_be_a_number(tmp_path, native, sim_env):
    env = machine(tmp_path, sim_env, ["context_mib=lots", "gpu mem=1GiB"])
    proc = subprocess.run([str(native / "bin" / "cgpu-sim-stat")], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "bad setting context_mib=lots" in proc.stderr


def test_with_libcuda_mps_lists_and_processes_utilization_info(libcuda, sim_env):
    spinner = start_py(sim_env, SPINNER)
    try:
        pid = json.loads(spinner.stdout.readline())
        got = nvml(
            sim_env,
            """
            n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
            old = [[s.pid, s.smUtil] for s in n.nvmlDeviceGetProcessUtilization(h, 0)]
            new = [[s.pid, s.smUtil, s.timeStamp, s.memUtil, s.jpgUtil, s.ofaUtil]
                   for s in n.nvmlDeviceGetProcessesUtilizationInfo(h, 0)]
            later = err(lambda: n.nvmlDeviceGetProcessesUtilizationInfo(h, new[0][2]))
            # The raw protocol: a bad version, then a NULL array asking for the size.
            info = n.c_nvmlProcessesUtilizationInfo_v1_t(0)
            fn = n._nvmlGetFunctionPointer("nvmlDeviceGetProcessesUtilizationInfo")
            info.version = 0x02000018
            bad = fn(h, C.byref(info))
            info.version = n.ProcessesUtilizationInfo_v1
            size = [fn(h, C.byref(info)), info.processSamplesCount]
            print(json.dumps({"old": old, "new": new, "later": later, "bad": bad, "size": size,
                              "compute": [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
                              "mps": [n.nvmlDeviceGetMPSComputeRunningProcesses(h),
                                      n.nvmlDeviceGetMPSComputeRunningProcesses_v2(h)]}))
        """,
        )
        count = raw(
            sim_env,
            """
            lib.nvmlInit_v2(); count = C.c_uint(0)
            print(json.dumps([lib.nvmlDeviceGetMPSComputeRunningProcesses(handle(0), C.byref(count), None),
                              count.value]))
        """,
        )
    finally:
        spinner.send_signal(signal.SIGKILL)
        spinner.wait(timeout=30)
    # The simulation has no MPS server: its list is empty, as on a GPU without one.
    assert got["compute"] == [pid] and got["mps"] == [[], []]
    assert count == [0, 0]  # the legacy name too: SUCCESS with nothing to list
    [(old_pid, old_sm)] = got["old"]
    [(new_pid, new_sm, _, mem, jpg, ofa)] = got["new"]
    assert old_pid == new_pid == pid and old_sm > 0 and abs(new_sm - old_sm) <= 2, got
    assert (mem, jpg, ofa) == (0, 0, 0)
    assert got["later"] == "NVMLError_NotFound"
    assert got["bad"] == 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert got["size"] == [7, 1]  # INSUFFICIENT_SIZE and the count needed


@needs_root
def test_sim_stat_sample_names_namespaced_processes_by_the_samplers_pids(libcuda, native, sim_env):
    stat = str(native / "bin" / "cgpu-sim-stat")
    samplers = [
        subprocess.Popen(
            [*prefix, stat, "--sample", "0", "50", "0"],
            env=sim_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for prefix in ([], ["unshare", "-p", "-f", "--mount-proc", "--kill-child"])
    ]
    try:
        for s in samplers:
            s.stdout.readline()  # running before the tenant starts
        with ns_tenants(sim_env, {"size": GIB, "gpu": 0, "spin_s": 0.3}) as [t]:
            done = sim_stat(native, sim_env)["now_ns"]  # its kernels have ended
            busy = sim_stat(native, sim_env, "--busy", "0", "0", str(done))
            lines = []
            for s in samplers:
                line = json.loads(s.stdout.readline())
                while line["now_ns"] <= done:
                    line = json.loads(s.stdout.readline())
                lines.append(line)
    finally:
        for s in samplers:
            s.kill()  # --kill-child: unshare's death takes the sampler with it
            s.wait(timeout=30)
    host, other = lines
    assert busy["per_pid"] == {str(t.host_pid): busy["busy_ns"]} and busy["busy_ns"] >= 250_000_000
    assert host["per_pid"] == {str(t.host_pid): busy["busy_ns"]}
    # From another namespace the process is not visible: its time counts for the GPU only.
    assert other["per_pid"] == {} and other["busy_ns"] == busy["busy_ns"]
