"""GPU memory sizes (cgpud/units.py): the one parser every --mem goes
through, so a bare number means GiB in each of cgpuctl's entry points."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cgpud.cli import main as cgpuctl
from cgpud.errors import UsageError
from cgpud.units import GIB, MIB, TIB, format_memory, parse_memory


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4", 4 * GIB),
        ("0", 0),
        ("4GiB", 4 * GIB),
        ("4 gib", 4 * GIB),
        ("512MiB", 512 * MIB),
        ("1.5GiB", 3 * GIB // 2),
        ("1073741824B", GIB),
        (" 16 ", 16 * GIB),
        ("1TiB", TIB),
        ("2 TiB", 2 * TIB),
        ("64KiB", 64 << 10),
        ("1.1GiB", (11 * GIB) // 10),  # rounded down to whole bytes
    ],
)
def test_memory_sizes(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1", "4GB", "4 gigs", "1e3", "0x10", "1.5B", "4 GiB per GPU"])
def test_bad_memory_sizes_say_what_is_accepted(text):
    with pytest.raises(UsageError) as err:
        parse_memory(text)
    assert str(err.value).startswith(f"bad memory size {text!r}: ")
    assert str(err.value).endswith(
        "a bare number is GiB as in aliyun.com/gpu-mem (4); else add B, KiB, MiB, GiB or TiB (512MiB, 1.5GiB)"
    )


def test_absurd_memory_size_is_refused():
    with pytest.raises(UsageError, match="larger than any GPU"):
        parse_memory("99999999999TiB")


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (4 * GIB, "4 GiB"),
        (0, "0 GiB"),
        (1536 * MIB, "1536 MiB"),
        (MIB // 2, "0.5 MiB"),
        (MIB + MIB // 3, "1.33 MiB"),
        (1000, "1000 bytes"),
    ],
)
def test_format_memory(size, text):
    assert format_memory(size) == text


# --------------------------------------------------------------------------
# One meaning in every entry point: the verbs' own argparse and handlers


def _verb_memory(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> int:
    """The bytes a cgpuctl verb passes on for its --mem, through its handler."""
    from cgpud.cli import client, run

    seen: list[int] = []

    class Client:
        """Stands in for the local API client: records what `create` asks."""

        def __init__(self, socket: Any, **options: Any) -> None:
            pass

        def __enter__(self) -> Client:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def create(self, request: Any) -> Any:
            seen.append(request.memory)
            return SimpleNamespace(id="cgpu-000000000000")

    monkeypatch.setattr(run, "run", lambda socket, request, *a, **kw: seen.append(request.memory) or 0)
    monkeypatch.setattr(client, "LocalClient", Client)
    if argv[0] == "sim":
        args = cgpuctl.build_parser().parse_args(argv)
        return cgpuctl._machine(args).memory
    assert cgpuctl.main(["--socket", "/nonexistent/cgpud.sock", *argv]) == 0
    [memory] = seen
    return memory


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--mem", "{}", "--", "true"],
        ["create", "--mem", "{}", "--name", "n"],
        ["sim", "env", "--mem", "{}"],
        ["sim", "reset", "--mem", "{}"],
        ["sim", "demo", "--mem", "{}"],
    ],
    ids=lambda argv: " ".join(argv[:2]) if argv[0] == "sim" else argv[0],
)
@pytest.mark.parametrize(("text", "size"), [("16", 16 * GIB), ("512MiB", 512 * MIB), ("1.5GiB", 3 * GIB // 2)])
def test_every_mem_option_reads_a_bare_number_as_gib(monkeypatch, argv, text, size):
    assert _verb_memory(monkeypatch, [a.format(text) for a in argv]) == size


def test_sim_default_memory_is_the_machine_default():
    args = cgpuctl.build_parser().parse_args(["sim", "env"])
    assert cgpuctl._machine(args).memory == 80 * GIB


@pytest.mark.parametrize(
    "verb", [["run", "--mem", "lots", "--", "true"], ["create", "--mem", "lots"], ["sim", "env", "--mem", "lots"]]
)
def test_a_bad_mem_is_one_clear_line(capsys, verb):
    assert cgpuctl.main(["--socket", "/nonexistent/cgpud.sock", *verb]) == 1
    assert capsys.readouterr().err == (
        "cgpuctl: bad memory size 'lots': a bare number is GiB as in aliyun.com/gpu-mem (4); "
        "else add B, KiB, MiB, GiB or TiB (512MiB, 1.5GiB)\n"
    )
