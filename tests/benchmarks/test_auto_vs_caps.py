"""benchmarks/experiments/auto_vs_caps.py: torch's best cap and auto's ratio to it, from made-up block times (no processes).

Every wrapper is timed in the same rounds, so a drift of the machine
between rounds moves all of them together: the ratio is taken within each
round. torch's best cap is the lowest median step of the even rounds, and
the ratio to it is taken in the odd ones.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "benchmarks", "experiments"), os.path.join(ROOT, "benchmarks")]

import auto_vs_caps  # noqa: E402
from auto_vs_caps import pooled_interval, report, run_figures, verdict  # noqa: E402

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


def test_the_target_is_judged_on_the_interval():
    assert verdict(0.99, 1.02) == "met"
    assert verdict(1.021, 1.05) == "missed"
    assert verdict(0.99, 1.05) == "not told apart"
    assert auto_vs_caps.TARGET == 1.02


def test_the_ratios_pooled_are_the_odd_rounds_against_the_best_cap():
    blocks = _blocks({0.25: 50.0, 1.0: 40.0, 5.0: 45.0, 25.0: 48.0}, auto_ms=40.0, drift=[1.0] * 8)
    blocks["minddp_auto"] = [40.0, 44.0, 40.0, 40.0, 40.0, 42.0, 40.0, 46.0]  # slower in the odd rounds only
    assert run_figures(blocks, CAPS)["auto_over_best_rounds"] == pytest.approx([1.1, 1.0, 1.05, 1.15])


def test_the_pooled_interval_narrows_with_rounds_and_keeps_each_runs_weight():
    noisy = [0.90, 1.10, 0.95, 1.05, 1.00]  # one run: median 1.00, the rounds spread 10% either way
    median, low, high = pooled_interval([noisy])
    assert median == pytest.approx(1.0) and low < 0.96 and high > 1.04
    median, low, high = pooled_interval([noisy * 20])  # the same spread over 100 rounds
    assert median == pytest.approx(1.0) and 0.96 < low <= 1.0 <= high < 1.04
    # Runs that agree narrow it as rounds do: six runs of the noisy rounds
    median, low, high = pooled_interval([noisy * 4] * 6)
    assert median == pytest.approx(1.0) and 0.96 < low <= 1.0 <= high < 1.04


def test_the_pooled_interval_holds_how_much_the_runs_differ():
    # Two runs, each steady, one level with torch's best, one 10% slower. Their rounds leave no doubt
    # about either run; which of them a next run resembles is the doubt: the runs are resampled too.
    assert pooled_interval([[1.0] * 10, [1.1] * 10]) == pytest.approx((1.05, 1.0, 1.1))
    # Six runs whose medians drift by 3% either way (as a day's runs on a shared machine move a
    # pair by as much as the target), each of 40 quiet rounds: the rounds alone would put the median
    # within a fraction of a percent; the runs' drift keeps 1.02 inside.
    drifting = [[level * (1 + 0.005 * ((k % 5) - 2)) for k in range(40)]
                for level in (0.985, 1.045, 1.00, 1.03, 0.99, 1.04)]
    median, low, high = pooled_interval(drifting)
    assert low < 1.0 and high > 1.03 and verdict(low, high) == "not told apart"


def test_the_table_judges_the_target_on_every_runs_rounds_together():
    cfg = {"caps": CAPS, "models": ["mlp"], "world_size": 2, "link": "loopback", "repeats": 40}
    level = _blocks({0.25: 50.0, 1.0: 40.0, 5.0: 45.0, 25.0: 48.0}, auto_ms=40.0, drift=[1.0] * 40)
    slow = _blocks({0.25: 50.0, 1.0: 40.0, 5.0: 45.0, 25.0: 48.0}, auto_ms=44.0, drift=[1.0] * 40)
    run = {"auto_buckets": 2}
    row = report(cfg, [{"mlp": {**run, "block_ms": level}}] * 3).splitlines()[-1]
    assert "| 1.000 [1.000, 1.000] |" in row and row.endswith("| met |")
    row = report(cfg, [{"mlp": {**run, "block_ms": slow}}] * 3).splitlines()[-1]
    assert "| 1.100 [1.100, 1.100] |" in row and row.endswith("| missed |")


def _saved(models: dict[str, float], repeats: int, link: str = "1gbit") -> dict:
    """A JSON as the script writes it: one run, auto at ``models[m]`` ms against torch's best 40 ms."""
    cfg = {"caps": CAPS, "models": list(models), "world_size": 2, "link": link, "repeats": repeats}
    run = {m: {"auto_buckets": 2, "block_ms": _blocks({0.25: 50.0, 1.0: 40.0, 5.0: 45.0, 25.0: 48.0},
                                                      auto_ms=ms, drift=[1.0] * repeats)}
           for m, ms in models.items()}
    return {"config": cfg, "runs": [run]}


def test_several_jsons_pool_each_models_runs_from_the_files_that_hold_it():
    first = _saved({"mlp": 40.0, "ae": 40.0, "gpt": 40.0}, repeats=40)  # level with torch's best
    second = _saved({"ae": 44.0, "gpt": 44.0}, repeats=100)  # 10% slower
    [(cfg, runs)] = auto_vs_caps.pooled_runs([first, second])
    assert cfg["models"] == ["mlp", "ae", "gpt"] and len(runs) == 2
    table = report(cfg, runs).splitlines()
    assert "1 to 2 runs a model, of 40 to 100 rounds" in table[0]
    assert table[-3].startswith("| mlp |") and "| 1.000 [1.000, 1.000] | 0.833" in table[-3]
    assert table[-3].endswith("| met |")
    # 20 odd rounds at 1.00 and 50 at 1.10: the pooled median is the second run's, each run its own
    # weight; the interval spans both runs, which disagree
    assert table[-1].startswith("| gpt |") and "| 1.100 [1.000, 1.100] |" in table[-1]
    assert "| 1.050 [1.000, 1.100] |" in table[-1]  # per run: median [min, max]


def test_runs_of_another_link_or_ranks_make_a_table_of_their_own():
    four_ranks = _saved({"ae": 44.0}, 40)
    four_ranks["config"]["world_size"] = 4
    groups = auto_vs_caps.pooled_runs(
        [_saved({"ae": 40.0}, 40), _saved({"ae": 40.0}, 40, link="loopback"), _saved({"ae": 40.0}, 40), four_ranks])
    assert [(cfg["link"], cfg["world_size"], len(runs)) for cfg, runs in groups] == [
        ("1gbit", 2, 2), ("loopback", 2, 1), ("1gbit", 4, 1)]
    assert "(4 ranks, 1gbit, 1 run(s) of 40 rounds)" in report(*groups[-1])


def test_minddp_at_fixed_plans_is_set_against_torchs_best_cap_in_the_same_rounds():
    # --plans: MiniDDP at a fixed plan beside the caps, to tell auto's choice from MiniDDP's step at it
    cfg = {"caps": CAPS, "models": ["mlp"], "world_size": 2, "link": "loopback", "repeats": 40, "plans": [[4.0, 4.0]]}
    blocks = _blocks({0.25: 50.0, 1.0: 40.0, 5.0: 45.0, 25.0: 48.0}, auto_ms=44.0, drift=[1.0] * 40)
    blocks["minddp@4:4"] = [42.0, 46.0] * 20  # 46 in the odd rounds, where it is judged
    run = {"mlp": {"auto_buckets": 3, "plan_buckets": {"minddp@4:4": 3}, "block_ms": blocks}}
    figures = run_figures(blocks, CAPS, ["minddp@4:4"])
    assert figures["plans_over_best_rounds"]["minddp@4:4"] == pytest.approx([46.0 / 40.0] * 20)
    table = report(cfg, [run] * 2)
    assert "| mlp | 4:4 | 3,3 | 44.0 | 1.150 [1.150, 1.150] |" in table.splitlines()


def test_runs_with_and_without_fixed_plans_pool_without_the_plans_table():
    with_plans = _saved({"ae": 40.0}, 40)
    with_plans["config"]["plans"] = [[4.0, 4.0]]
    for run in with_plans["runs"]:
        run["ae"]["block_ms"]["minddp@4:4"] = [40.0] * 40
        run["ae"]["plan_buckets"] = {"minddp@4:4": 1}
    [(cfg, runs)] = auto_vs_caps.pooled_runs([with_plans, _saved({"ae": 40.0}, 40)])
    assert cfg["plans"] == [] and len(runs) == 2
    assert "fixed plans" not in report(cfg, runs)
    [(cfg, runs)] = auto_vs_caps.pooled_runs([with_plans, with_plans])
    assert "| ae | 4:4 | 1,1 | 40.0 | 1.000 [1.000, 1.000] |" in report(cfg, runs).splitlines()
