"""How far ``compare.py`` is: one live line on a terminal, a few plain lines anywhere else.

A run of the benchmark takes minutes, in several sets of rank processes one
after another (one per row of every ``--runs``, the extras, the memory run). Rank 0 of each
reports here, so the count runs on across them: the work is counted in
*rounds* (``--repeats`` per model and cap and run) plus one unit per row of
the memory run, and the parent passes its start time along, so that elapsed
and remaining time span the whole benchmark.

* **live** (stderr is a terminal, ``CI`` unset, ``TERM`` not ``dumb``): one
  line redrawn in place, ``[#####-----]  37%  run 2/5, mlp, cap 25 MB, round
  3/8  1:23 elapsed, ~2:10 left``; a note (``plan_buckets``'s
  decision) is printed above it;
* **plain** (a pipe, a log file, CI): one line per stage (a model and cap in
  one run, the memory run), never one per round.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import TextIO

BAR_WIDTH = 24
CLEAR = "\r\x1b[K"  # to the line's start, erase it


def is_live(stream: TextIO, env: dict | None = None) -> bool:
    """A terminal a person watches (and not a CI log that happens to be a terminal)."""
    env = os.environ if env is None else env
    return stream.isatty() and not env.get("CI") and env.get("TERM", "") != "dumb"


def total_units(cfg: dict) -> int:
    """Every round of every run, and one unit per row of the memory run."""
    cases = len(cfg["models"]) * len(cfg["bucket_caps"])
    return cfg["runs"] * cases * cfg["repeats"] + cases


def units_before(cfg: dict, run: int, case: int, round_: int = 0) -> int:
    """The units done when ``run``'s ``case``'s round ``round_`` starts (all counted from 0)."""
    cases = len(cfg["models"]) * len(cfg["bucket_caps"])
    return (run * cases + case) * cfg["repeats"] + round_


def clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Where the benchmark is, written to ``stream``; one per process (rank 0's, and the parent's)."""

    def __init__(self, total: int, started: float | None = None, stream: TextIO | None = None,
                 live: bool | None = None, prefix: str = "[compare]"):  # fmt: skip
        self.total, self.stream, self.prefix = max(1, total), stream or sys.stderr, prefix
        self.started = time.time() if started is None else started
        self.live = is_live(self.stream) if live is None else live
        self._stage: str | None = None
        self._drawn = False

    def update(self, done: int, stage: str, detail: str = "") -> None:
        """``done`` units of ``total``, now in ``stage`` (``detail``: what changes within it, e.g. the round)."""
        if self.live:
            self._draw(done, f"{stage}, {detail}" if detail else stage)
        elif stage != self._stage:
            self._print(f"{self.prefix} {stage} ({self._times(done)})")
        self._stage = stage

    def note(self, text: str) -> None:
        """A line that stays (above the live line, which the next update draws again)."""
        self._print(f"{self.prefix} {text}")

    def finish(self, text: str = "") -> None:
        """Clear the live line; print ``text`` if any."""
        if self._drawn:
            self.stream.write(CLEAR)
            self._drawn = False
        if text:
            self._print(f"{self.prefix} {text}")
        self.stream.flush()

    def _times(self, done: int) -> str:
        elapsed = time.time() - self.started
        if done <= 0:
            return f"{clock(elapsed)} elapsed"
        left = elapsed / done * (self.total - done)
        return f"{clock(elapsed)} elapsed, ~{clock(left)} left"

    def _draw(self, done: int, text: str) -> None:
        done = min(max(done, 0), self.total)
        filled = BAR_WIDTH * done // self.total
        line = f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {100 * done // self.total:3d}%  {text}  {self._times(done)}"
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write(CLEAR + line[:width])
        self.stream.flush()
        self._drawn = True

    def _print(self, line: str) -> None:
        if self.live:  # over the live line, this process's or the one an earlier run left
            self.stream.write(CLEAR)
            self._drawn = False
        self.stream.write(line + "\n")
        self.stream.flush()
