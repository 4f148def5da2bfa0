"""cgpuctl sim: sizes, the config it writes, and its one-line errors."""
from __future__ import annotations

import pytest

from cgpud.cli.simulator import SimMachine, parse_size
from cgpud.errors import UsageError


@pytest.mark.parametrize(
    ("text", "size"),
    [("16GiB", 16 << 30), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096), ("2 TiB", 2 << 40)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "16GB", "16 gigs", "1e3"])
def test_bad_sizes_name_the_accepted_units(text):
    with pytest.raises(UsageError, match="use a number with B, KiB, MiB, GiB or TiB"):
        parse_size(text)


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
    ],
)
def test_impossible_machines_are_refused(machine, message):
    with pytest.raises(UsageError, match=message):
        machine.validate()
