"""What the published-curve scripts share (``published_scaling.py``, ``published_horovod.py``): the worst miss
on a set of rows, the targets line under each table, and the command line with ``--fit``."""

from __future__ import annotations

import argparse
from typing import Callable, Iterable


def worst_miss(got: dict, keys: Iterable) -> float:
    """The largest |predicted - published| efficiency over the rows of ``keys``; ``got``: key -> (published,
    predicted), each a sequence over the cluster sizes."""
    return max(abs(b - a) for key in keys for a, b in zip(*got[key]))


def targets_line(worst_points: dict[str, float], target_points: float) -> str:
    """``worst_points``: set (calibration, held out) -> its worst miss in points."""
    return f"targets (every point within {target_points:g} points): " + "; ".join(
        f"{kind} worst {miss:.1f} points, {'met' if miss <= target_points else 'MISSED'}"
        for kind, miss in worst_points.items())


def run(description: str, what: str, fit: Callable[[], float], fitted: float, table: Callable[[float], str],
        said: Callable[[float], str], argv: list[str] | None = None) -> int:
    """``--fit`` refits the one fitted figure (``what``) and prints ``said(figure)``; the table either way."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--fit", action="store_true", help=f"refit {what} on the calibration rows")
    figure = fitted
    if p.parse_args(argv).fit:
        figure = fit()
        print(said(figure))
    print(table(figure))
    return 0
