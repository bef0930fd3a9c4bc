"""The two ways every table of ``compare.py`` writes a cell or a table: a figure with its spread, a Markdown table."""

from __future__ import annotations


def with_spread(row: dict, key: str, fmt: str) -> str:
    """``median [min, max]`` of a figure over runs (the median alone after one run)."""
    if row["runs"] == 1:
        return fmt.format(row[key])
    return f"{fmt.format(row[key])} [{fmt.format(row[key + '_min'])}, {fmt.format(row[key + '_max'])}]"


def markdown_table(titles: list[str], cells_all: list[list[str]]) -> str:
    """A Markdown table, first column left-aligned, the others right-aligned."""
    widths = [max([len(t)] + [len(cells[i]) for cells in cells_all]) for i, t in enumerate(titles)]
    lines = ["| " + " | ".join(t.ljust(w) for t, w in zip(titles, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in cells_all:
        lines.append("| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |")
    return "\n".join(lines)
