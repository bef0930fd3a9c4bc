"""The command line's number types: a bad value gets one line naming the flag and what it accepts.

``python -m minddp_lab.simulate --compute-scale 0`` answers
``error: argument --compute-scale: must be a number > 0, got '0'``, never a
traceback, a division by zero or a negative time.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

__all__ = ["OneLineParser", "positive", "at_least_zero", "whole", "listed", "one_line_errors"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block above them)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        print(f"error: {message} (--help lists every flag)", file=sys.stderr)
        sys.exit(2)


def _number(text: str, kind: type, test: Callable[[float], bool], accepts: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not test(value):
        raise argparse.ArgumentTypeError(f"must be {accepts}, got {text!r}")
    return value


def positive(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a number > 0")


def at_least_zero(text: str) -> float:
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


def whole(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a whole number >= 1")


def listed(one: Callable) -> Callable[[str], list]:
    """Comma-separated values of type ``one``: ``8,64,512``."""
    def parse(text: str) -> list:
        values = [one(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"needs at least one value, got {text!r}")
        return values

    return parse


def one_line_errors(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)``, with a bad input (ValueError, OSError) printed as one line and exit status 2."""
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
