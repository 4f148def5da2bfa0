"""README.md's command blocks, for the tests that run them (issue 41).

Every ```sh block follows a mark, `<!-- readme: VENUE -->`, on the line
before it, naming where the tests run it:

- `top`: the two commands (`./dev demo`, `./dev test`): CI runs the second,
  tests/integration/test_install.py the first in a fresh copy;
- `sim`: in the clone, on the simulated GPU (tests/integration/test_readme_sim.py);
- `host`: in a booted Debian 12 with the deb at hand (tests/packaging/test_readme_host.py);
- `kube`: on the real cluster (tests/realkube/test_readme_kube.py);
- `gpu (REASON)`: not run here; the reason says what it needs.

A block's lines are run by bash as they stand. The tests give each venue
only what a user's machine there has: the driver (here simulated), a
kubeconfig, the package file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
VENUES = ("top", "sim", "host", "kube", "gpu")
MARK = re.compile(r"^<!-- readme: (\w+)(?: \((.+)\))? -->$")


class ReadmeError(ValueError):
    pass


@dataclass(frozen=True)
class Block:
    venue: str
    reason: str  # why a `gpu` block is not run
    line: int  # of the opening fence, 1-based
    text: str

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str) -> list[Block]:
    """Every ```sh block with its mark; a block without one, or a mark
    without a block, is an error that names the line."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        mark = MARK.match(line)
        if mark and (i + 1 >= len(lines) or lines[i + 1] != "```sh"):
            raise ReadmeError(f"README.md:{i + 1}: a mark must be followed by a ```sh block")
        if line.startswith("```sh"):
            prev = MARK.match(lines[i - 1]) if i else None
            if prev is None:
                raise ReadmeError(f"README.md:{i + 1}: a ```sh block without a `<!-- readme: VENUE -->` mark")
            venue, reason = prev[1], prev[2] or ""
            if venue not in VENUES:
                raise ReadmeError(f"README.md:{i}: unknown venue {venue!r} (one of {', '.join(VENUES)})")
            if venue == "gpu" and not reason:
                raise ReadmeError(f"README.md:{i}: a `gpu` block must say why it cannot run here")
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
            if end is None:
                raise ReadmeError(f"README.md:{i + 1}: the block is not closed")
            found.append(Block(venue, reason, i + 1, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


def readme_blocks(venue: str) -> list[Block]:
    return [b for b in blocks(README.read_text()) if b.venue == venue]
