"""The one way benchmarks print a table: first column left, numbers right."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def print_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    print(line(head))
    print(line(tuple("-" * w for w in widths)))
    for row in rows:
        print(line(row))


def ab_row(label: str, this: Sequence[float], baseline: Sequence[float], spread: bool = False) -> list[str]:
    """One row of a side-by-side table: each side's median (with its
    min-max when `spread`) and this / baseline of the medians."""

    def cell(values: Sequence[float]) -> str:
        text = f"{statistics.median(values):.1f}"
        return f"{text} ({min(values):.0f}-{max(values):.0f})" if spread else text

    return [label, cell(this), cell(baseline), f"{statistics.median(this) / statistics.median(baseline):.2f}"]
