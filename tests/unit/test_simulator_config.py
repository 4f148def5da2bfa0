"""cgpuctl sim: the config it writes, and its one-line errors (sizes: test_units.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cgpud.cli.simulator import MIG_PROFILES, SimMachine
from cgpud.errors import UsageError


def test_config_has_one_gpu_line_each_and_nvlink_peers():
    text = SimMachine(gpus=3, memory=16 << 30, nvlink=True).config_text()
    gpu_lines = [line for line in text.splitlines() if line.startswith("gpu ")]
    assert len(gpu_lines) == 3
    assert gpu_lines[0].endswith("nvlink=1,2") and gpu_lines[2].endswith("nvlink=0,1")
    assert f"mem={16 << 30}B" in gpu_lines[1]


@pytest.mark.parametrize(
    ("machine", "message"),
    [
        (SimMachine(gpus=0), "--gpus must be between 1 and 16"),
        (SimMachine(gpus=17), "--gpus must be between 1 and 16"),
        (SimMachine(memory=1000), "--mem must be at least 1MiB"),
        (SimMachine(sms=0), "--sms must be at least 1"),
        (SimMachine(name='a"b'), "--name must not contain quotes"),
        (SimMachine(gpus=4, topology="dgx1"), "--topology dgx1 has 8 GPUs: use --gpus 8"),
        (SimMachine(gpus=8, topology="hgx"), "unknown --topology 'hgx': use one of dgx1, hgx8, pcie4, nvlink2x2"),
        (SimMachine(mig="1g.5gb"), "--mig: unknown MIG profile '1g.5gb'"),
        (SimMachine(memory=16 << 30, mig="1g.10gb"), "--mig needs the H100 80GB shape"),
        (SimMachine(gpus=4, mig="1g.10gb,1g.10gb,1g.10gb,1g.10gb"), "4 GPUs with 4 MIG devices each exceed 16"),
    ],
)
def test_impossible_machines_are_refused(machine, message):
    with pytest.raises(UsageError, match=message):
        machine.validate()


def test_a_topology_places_each_gpu():
    lines = [ln for ln in SimMachine(gpus=4, topology="nvlink2x2").config_text().splitlines() if ln.startswith("gpu ")]
    assert [ln.split("sms=132 ")[1] for ln in lines] == [
        "socket=0 nvlink=1*2",
        "socket=0 nvlink=0*2",
        "socket=1 nvlink=3*2",
        "socket=1 nvlink=2*2",
    ]


def test_mig_boots_every_gpu_with_the_layout_and_names_the_simulators_profiles():
    lines = [ln for ln in SimMachine(mig="3g.40gb,1g.10gb").config_text().splitlines() if ln.startswith("gpu ")]
    assert len(lines) == 2 and all(ln.endswith(" mig=3g.40gb,1g.10gb") for ln in lines)
    source = (Path(__file__).resolve().parents[2] / "csrc" / "simgpu" / "simmig.c").read_text()
    assert tuple(re.findall(r'^    \{"([^"]+)", ', source, re.M)) == MIG_PROFILES
