"""What compare.py shows a person: one live progress line on a terminal, a few plain lines elsewhere, and a
summary first whose verdicts follow the spread over runs (no processes: made-up rows and a fake terminal)."""

import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # where `python benchmarks/compare.py` finds benchlib

from benchlib import progress, summary  # noqa: E402
from benchlib.progress import CLEAR, Progress  # noqa: E402


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


CFG = {"models": ["mlp", "gpt"], "bucket_caps": [1.0, 25.0], "runs": 3, "repeats": 8}


def test_every_round_and_the_memory_run_count_once_and_the_last_unit_is_the_total():
    total = progress.total_units(CFG)
    assert total == 3 * 4 * 8 + 4  # runs x (model, cap) x rounds, and one per row of the memory run
    assert progress.units_before(CFG, run=2, case=3, round_=7) == total - 4 - 1
    assert progress.units_before(CFG, run=3, case=0) == total - 4  # where the memory run starts


def test_a_terminal_gets_one_line_redrawn_in_place_and_notes_above_it(monkeypatch):
    monkeypatch.delenv("CI", raising=False)  # a person's terminal (CI sets CI: plain lines, tested below)
    monkeypatch.setenv("TERM", "xterm")
    out = Terminal()
    bar = Progress(100, started=0.0, stream=out)
    assert bar.live
    for r in range(8):
        bar.update(r, "run 1/3, mlp, cap 25 MB", f"round {r + 1}/8")
    bar.note("mlp: MiniDDP plan_buckets: 3 bucket(s)")
    bar.update(50, "run 2/3, gpt, cap 1 MB", "round 1/8")
    bar.finish()
    text = out.getvalue()
    assert text.count("\n") == 1, "only the note ends a line"
    assert text.count(CLEAR) == 8 + 1 + 1 + 1  # every redraw, the note, the redraw after it, the end
    assert "[" + "#" * 12 + "-" * 12 + "]  50%" in text and "round 8/8" in text
    assert text.endswith(CLEAR)  # the summary starts on a clean line


def test_a_pipe_or_ci_gets_one_plain_line_per_stage_never_one_per_round():
    out = io.StringIO()
    bar = Progress(100, started=0.0, stream=out)
    assert not bar.live
    for stage in ("run 1/3, mlp, cap 25 MB", "run 1/3, gpt, cap 25 MB"):
        for r in range(8):
            bar.update(r, stage, f"round {r + 1}/8")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["[compare] run 1/3, mlp, cap 25 MB", "[compare] run 1/3, gpt, cap 25 MB"]
    assert "\r" not in out.getvalue() and "round" not in out.getvalue()
    assert not progress.is_live(Terminal(), env={"CI": "true"}) and not progress.is_live(Terminal(), env={"TERM": "dumb"})
    assert progress.is_live(Terminal(), env={"TERM": "xterm"})


def _row(model, cap, ratio_copy, ratio_auto, torch_ms, runs=3, **extra):
    row = {"model": model, "bucket_cap_mb": cap, "runs": runs, "torch_copy_ms": torch_ms, "minddp_copy_ms": torch_ms,
           "minddp_auto_ms": torch_ms * ratio_auto[0], "auto_buckets": 3}
    for key, (med, lo, hi) in (("ratio_copy", ratio_copy), ("ratio_auto", ratio_auto)):
        row.update({key: med, f"{key}_min": lo, f"{key}_max": hi})
    return {**row, **extra}


def test_the_verdict_reads_the_whole_spread_not_the_median():
    assert summary.verdict(_row("m", 25, (0.95, 0.90, 0.99), (1, 1, 1), 10), "ratio_copy") == "faster"
    assert summary.verdict(_row("m", 25, (1.05, 1.01, 1.10), (1, 1, 1), 10), "ratio_copy") == "slower"
    assert summary.verdict(_row("m", 25, (0.95, 0.90, 1.01), (1, 1, 1), 10), "ratio_copy") == "even"
    assert summary.verdict(_row("m", 25, (0.95, 0.95, 0.95), (1, 1, 1), 10, runs=1), "ratio_copy") == ""


def test_one_line_per_model_at_the_main_cap_with_auto_against_torchs_best_cap_against_it():
    cfg = {"bucket_cap_mb": 25.0, "bucket_views": ["copy"], "backend": "gloo", "device": "cpu", "world_size": 2}
    rows = [_row("mlp", 1.0, (1.0, 0.98, 1.03), (1.04, 1.02, 1.06), torch_ms=90.0),
            _row("mlp", 25.0, (1.0, 0.97, 1.01), (0.82, 0.80, 0.85), torch_ms=120.0),
            _row("gpt", 1.0, (1.0, 0.98, 1.03), (0.97, 0.95, 0.99), torch_ms=50.0),
            _row("gpt", 25.0, (1.02, 1.01, 1.03), (0.96, 0.90, 1.01), torch_ms=48.0)]  # fmt: skip
    lines = summary.summary(cfg, rows).splitlines()
    assert lines[0].startswith("Summary") and len(lines) == 3
    mlp, gpt = lines[1], lines[2]
    assert mlp.lstrip().startswith("mlp ") and "25 MB: copy 1.000 [0.970, 1.010] even" in mlp
    assert "torch default 0.820 [0.800, 0.850] faster" in mlp
    assert "auto / torch's best cap (1 MB) 1.040 [1.020, 1.060] slower" in mlp  # the highest auto / torch
    assert "copy 1.020 [1.010, 1.030] slower" in gpt and "torch's best cap (1 MB) 0.970 [0.950, 0.990] faster" in gpt


def test_the_fastest_cap_is_read_against_the_bound_of_the_same_rounds_where_there_is_one():
    """The machine slowed down while the 25 MB row ran: its step is longer, but closer to its bound."""
    rows = [_row("mlp", 1.0, (1, 1, 1), (1, 1, 1), torch_ms=100.0, x_bound_torch_copy=1.20),
            _row("mlp", 25.0, (1, 1, 1), (1, 1, 1), torch_ms=150.0, x_bound_torch_copy=1.10)]
    assert summary.fastest(rows, "torch_copy")["bucket_cap_mb"] == 25.0
    del rows[0]["x_bound_torch_copy"]  # not every row has it: the step times decide
    assert summary.fastest(rows, "torch_copy")["bucket_cap_mb"] == 1.0
