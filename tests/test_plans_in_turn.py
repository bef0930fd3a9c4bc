"""benchmarks/plans_in_turn.py: each plan against the default round by round, and the windows of rounds auto reads."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from plans_in_turn import report, round_ratios, window_medians  # noqa: E402

from minddp_lab.auto.trials import TRIAL_ROUNDS  # noqa: E402


def test_each_round_sets_a_plans_block_against_the_defaults():
    blocks = {"default": [[50.0, 50.0], [100.0, 60.0]], "one": [[45.0, 45.0], [72.0, 88.0]]}
    assert round_ratios(blocks, "one", "default") == pytest.approx([0.9, 1.0])


def test_a_window_is_what_one_decision_reads_and_a_partial_window_is_left_out():
    ratios = [0.9] * TRIAL_ROUNDS + [1.0] * TRIAL_ROUNDS + [0.5] * 5  # by default a window is auto's trial rounds
    assert window_medians(ratios) == pytest.approx([0.9, 1.0])
    assert window_medians(ratios, window=TRIAL_ROUNDS // 2) == pytest.approx([0.9, 0.9, 1.0, 1.0])


def test_the_table_has_a_row_per_plan():
    blocks = {"a": [[10.0, 10.0]] * TRIAL_ROUNDS, "b": [[9.0, 9.0]] * TRIAL_ROUNDS}
    measured = {"blocks": blocks, "buckets": {"a": 2, "b": 1}}
    lines = report(measured, ["a", "b"]).splitlines()
    assert lines[-1] == "| b | 1 | 9.0 | 0.900 | 0.900 |"
