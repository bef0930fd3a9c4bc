"""benchmarks/auto_vs_caps.py: torch's best cap and auto's ratio to it, from made-up block times (no processes).

Every wrapper is timed in the same rounds, so a drift of the machine
between rounds moves all of them together: the ratio is taken within each
round. torch's best cap is the lowest median step of the even rounds, and
the ratio to it is taken in the odd ones.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import auto_vs_caps  # noqa: E402
from auto_vs_caps import run_figures, verdict  # noqa: E402

CAPS = [0.25, 1.0, 5.0, 25.0]


def _blocks(torch_ms: dict[float, float], auto_ms: float, drift: list[float]) -> dict[str, list[float]]:
    """Each wrapper's step in every round: its own step times the round's drift."""
    blocks = {f"torch@{cap:g}": [ms * d for d in drift] for cap, ms in torch_ms.items()}
    blocks["minddp_auto"] = [auto_ms * d for d in drift]
    return blocks


def test_the_best_cap_is_torchs_lowest_median_and_the_ratio_is_paired_within_rounds():
    drift = [1.0, 1.5, 0.8, 2.0, 1.1, 0.9, 1.3, 1.2]  # a loaded machine: every round at another speed
    blocks = _blocks({0.25: 50.0, 1.0: 40.0, 5.0: 45.0, 25.0: 48.0}, auto_ms=41.0, drift=drift)
    figures = run_figures(blocks, CAPS)
    assert figures["best_cap"] == 1.0
    assert figures["auto_over_best"] == pytest.approx(41.0 / 40.0)
    assert figures["auto_over_default"] == pytest.approx(41.0 / 48.0)


def test_a_quiet_spell_neither_picks_the_best_cap_nor_flatters_it():
    blocks = _blocks({0.25: 50.0, 1.0: 40.0, 5.0: 45.0, 25.0: 48.0}, auto_ms=40.0, drift=[1.0] * 8)
    blocks["torch@0.25"][2] = 10.0  # one quiet moment for torch at 0.25 MB alone: not its step
    blocks["torch@1"][3] = 10.0  # nor one for torch at 1 MB
    figures = run_figures(blocks, CAPS)
    assert figures["best_cap"] == 1.0
    assert figures["auto_over_best"] == pytest.approx(1.0)  # the median over rounds, not the mean


def test_the_rounds_that_choose_the_best_cap_are_not_those_that_judge_auto():
    # Equal caps, and noise: torch at 5 MB has its quiet rounds among the even ones, so it is chosen; a
    # ratio from those same rounds would put auto 10% behind a cap no faster than the others.
    blocks = _blocks({0.25: 50.0, 1.0: 50.0, 5.0: 50.0, 25.0: 50.0}, auto_ms=50.0, drift=[1.0] * 8)
    blocks["torch@5"] = [45.0, 50.0, 45.0, 50.0, 45.0, 50.0, 45.0, 50.0]
    figures = run_figures(blocks, CAPS)
    assert figures["best_cap"] == 5.0
    assert figures["auto_over_best"] == pytest.approx(1.0)


def test_the_target_is_met_only_when_every_run_is_within_two_percent():
    assert verdict([0.99, 1.02, 1.01]) == "met"
    assert verdict([1.03, 1.05, 1.021]) == "missed"
    assert verdict([0.99, 1.05, 1.01]) == "the runs disagree"
    assert auto_vs_caps.TARGET == 1.02
