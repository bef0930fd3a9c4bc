"""benchmarks/replay_trials.py: auto's trial rule (PlanTrials itself) replayed on made-up block times.

torch's caps stand in for auto's plans, torch's default for the default;
a window of rounds is what the trials would have timed, and the plan kept
is charged its ratio over every round against the best cap's.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from replay_trials import costs, kept  # noqa: E402

NAMES = ["torch@25", "torch@0.25", "torch@1", "torch@5"]


def _blocks(ms: dict[str, float], rounds: int) -> dict[str, list[float]]:
    return {name: [step] * rounds for name, step in ms.items()}


def test_a_steady_faster_cap_is_kept_in_every_window_and_costs_nothing():
    blocks = _blocks({"torch@25": 50.0, "torch@0.25": 60.0, "torch@1": 45.0, "torch@5": 48.0}, rounds=12)
    assert {kept(blocks, NAMES, start, 4) for start in range(9)} == {"torch@1"}
    assert costs(blocks, 4) == pytest.approx([0.0] * 9)


def test_a_gain_within_the_trials_threshold_keeps_the_default():
    blocks = _blocks({"torch@25": 50.0, "torch@0.25": 60.0, "torch@1": 49.8, "torch@5": 55.0}, rounds=8)
    assert kept(blocks, NAMES, 0, 4) == "torch@25"  # 0.4% faster: PlanTrials' 1% least gain not reached
    assert costs(blocks, 4) == pytest.approx([0.2 / 49.8] * 5)  # the default's 0.4% is the cost


def test_a_quiet_spell_in_the_window_keeps_a_slower_plan_and_is_charged_for_it():
    blocks = _blocks({"torch@25": 50.0, "torch@0.25": 60.0, "torch@1": 55.0, "torch@5": 52.5}, rounds=12)
    blocks["torch@5"][:4] = [40.0] * 4  # 5% slower over the run, 20% faster in its first four rounds
    assert kept(blocks, NAMES, 0, 4) == "torch@5" and kept(blocks, NAMES, 4, 4) == "torch@25"
    window_costs = costs(blocks, 4)
    assert window_costs[0] == pytest.approx(0.05) and window_costs[4:] == pytest.approx([0.0] * 5)


def test_each_plan_is_fed_its_own_block_of_the_same_round_so_the_machines_drift_cancels():
    blocks = _blocks({"torch@25": 50.0, "torch@0.25": 60.0, "torch@1": 45.0, "torch@5": 48.0}, rounds=12)
    drift = [3.0, 3.0, 1.0, 2.0] * 3  # rounds at other speeds, every plan alike in a round
    blocks = {name: [t * d for t, d in zip(times, drift)] for name, times in blocks.items()}
    assert {kept(blocks, NAMES, start, 4) for start in range(9)} == {"torch@1"}
