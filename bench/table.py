"""The one way benchmarks print a table: first column left, numbers right."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    print(line(head))
    print(line(tuple("-" * w for w in widths)))
    for row in rows:
        print(line(row))
