"""README.md's blocks are all marked with where the tests run them
(tests/harness/readme.py), and the marks are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.readme import README, ReadmeError, blocks

REPO = Path(__file__).resolve().parents[2]


def test_every_block_of_the_readme_is_marked_and_each_venue_has_one() -> None:
    found = blocks(README.read_text())
    venues = {b.venue for b in found}
    assert venues == {"top", "sim", "host", "kube", "gpu"}, venues
    assert all(b.reason for b in found if b.venue == "gpu")


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_second() -> None:
    first = blocks(README.read_text())[0]
    assert first.venue == "top"
    commands = [line.split("#")[0].strip() for line in first.text.splitlines()]
    assert commands == ["./dev demo", "./dev test"], commands
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("exec ./dev test")
    # The first runs in a fresh copy there (with a shorter demo).
    assert '"demo"' in (REPO / "tests" / "integration" / "test_install.py").read_text()


@pytest.mark.parametrize(
    "text, message",
    [
        ("```sh\nls\n```\n", "without a `<!-- readme: VENUE -->` mark"),
        ("<!-- readme: gpu -->\n```sh\nnvidia-smi\n```\n", "must say why"),
        ("<!-- readme: moon -->\n```sh\nls\n```\n", "unknown venue 'moon'"),
        ("<!-- readme: sim -->\ntext\n```sh\nls\n```\n", "must be followed by a ```sh block"),
        ("<!-- readme: sim -->\n```sh\nls\n", "not closed"),
    ],
)
def test_an_unmarked_or_badly_marked_block_is_an_error_naming_its_line(text: str, message: str) -> None:
    with pytest.raises(ReadmeError, match="README.md:") as e:
        blocks(text)
    assert message in str(e.value)


def test_a_marked_block_is_read_with_its_venue_reason_and_line() -> None:
    [b] = blocks("intro\n<!-- readme: gpu (needs nvidia-smi) -->\n```sh\nnvidia-smi\n```\n")
    assert (b.venue, b.reason, b.line, b.text) == ("gpu", "needs nvidia-smi", 3, "nvidia-smi\n")
