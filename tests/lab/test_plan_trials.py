"""plan_buckets times the plans the model proposed in turn: the schedule and the verdict, without a clock.

:class:`~minddp_lab.auto.trials.PlanTrials` is bookkeeping: made-up step
times go in, and the schedule (which plan each step runs, when to rebuild,
which steps are timed) and the verdict come out. Whether MiniDDP follows it
on every rank is checked end to end in tests/lab/test_bucket_planner.py.
"""

import random

import pytest

from minddp_lab.auto.trials import MIN_MEASURED_GAIN, PlanTrials

DEFAULT, FEWER, MORE, HALFWAY = (25.0, 1.0), (64.0, 64.0), (4.0, 4.0), (16.0, 1.0)


def _run(trials: PlanTrials, step_ms) -> list:
    """Feed every scheduled step ``step_ms(plan, round, step_in_block)``; the rebuilds asked for, in order."""
    rebuilds, per_round = [], trials.steps_per_trial * len(trials.plans)
    while not trials.done:
        position = trials.position
        plan = trials.current
        asked = trials.step_done(step_ms(plan, position // per_round, position % trials.steps_per_trial))
        if asked is not None:
            rebuilds.append(asked)
    return rebuilds


def test_each_round_runs_every_plan_for_a_block_the_order_rotating_and_rebuilds_only_between_blocks():
    trials = PlanTrials([DEFAULT, FEWER, MORE], rounds=3, steps_per_trial=3)
    assert trials.schedule == [DEFAULT] * 3 + [FEWER] * 3 + [MORE] * 3 + [FEWER] * 3 + [MORE] * 3 + [DEFAULT] * 3 \
        + [MORE] * 3 + [DEFAULT] * 3 + [FEWER] * 3
    assert trials.current == DEFAULT, "the first block's plan is built before the first trial step"
    rebuilds = _run(trials, lambda plan, r, k: 10.0)
    assert rebuilds == [FEWER, MORE, FEWER, MORE, DEFAULT, MORE, DEFAULT, FEWER], "one rebuild per new block"


def test_the_step_after_a_rebuild_is_not_timed():
    # Each block's first step pays for new buffers (100 ms here): it must not count against its plan.
    trials = PlanTrials([DEFAULT, MORE], rounds=2, steps_per_trial=3)
    _run(trials, lambda plan, r, k: 100.0 if k == 0 else (9.0 if plan == MORE else 10.0))
    assert trials.blocks == {DEFAULT: [[10.0, 10.0], [10.0, 10.0]], MORE: [[9.0, 9.0], [9.0, 9.0]]}
    assert trials.fastest() == MORE


def test_each_plan_is_set_against_the_default_in_the_same_round_so_a_drifting_machine_moves_no_ratio():
    # The machine slows down round after round (x1, x2, x4, x8): MORE is 5% faster than the default in every
    # round, FEWER 10% slower. Set against the default's block of its own round, each ratio comes out exact.
    speed = [1.0, 2.0, 4.0, 8.0]
    times = {DEFAULT: 10.0, FEWER: 11.0, MORE: 9.5}
    trials = PlanTrials([DEFAULT, FEWER, MORE], rounds=4)
    _run(trials, lambda plan, r, k: times[plan] * speed[r])
    ratios = {t.plan: t.ratio for t in trials.results()}
    assert ratios == pytest.approx({DEFAULT: 1.0, FEWER: 1.1, MORE: 0.95})
    assert trials.fastest() == MORE


def test_one_busy_round_does_not_decide():
    # A plan that is 5% slower, except in one round where the default's block was hit by a busy spell.
    trials = PlanTrials([DEFAULT, MORE], rounds=4)
    _run(trials, lambda plan, r, k: (30.0 if r == 1 else 10.0) if plan == DEFAULT else 10.5)
    assert trials.fastest() == DEFAULT, "the median ratio, not the mean: one spell is one round of four"


@pytest.mark.parametrize("halfway", [None, 1.03], ids=["three plans", "four plans"])
def test_enough_rounds_to_find_a_plan_4_percent_faster_through_the_noise_of_two_shared_cores(halfway):
    # On 2 shared cores a block's time moves by itself: the ratio of two blocks in one round spreads by 10% to
    # 15% (long auto_vs_caps.py runs at 1 Gbit/s and on loopback), a block here by 10% (the ratio's by 14%).
    # MORE is truly 4% faster than the default (missing it costs twice the 2% target), FEWER 3%
    # slower (keeping it misses the target), and with four plans HALFWAY 3% slower too: one more chance for
    # the noise to fool the verdict. The default number of rounds must find MORE in 7 windows of 10 and keep
    # each slower plan in at most 1 of 20.
    truth = {DEFAULT: 1.0, FEWER: 1.03, MORE: 0.96} | ({HALFWAY: halfway} if halfway else {})
    rng = random.Random(0)

    def one_window():
        trials, spell = PlanTrials(list(truth)), {}
        _run(trials, lambda plan, r, k: 100 * truth[plan] * (1 + r % 3)  # the machine drifts, too
             * spell.setdefault((r, plan), rng.lognormvariate(0, 0.10)))
        return trials.fastest()

    kept = [one_window() for _ in range(1000)]
    assert kept.count(MORE) / len(kept) >= 0.70, f"the faster plan kept in {kept.count(MORE)} of {len(kept)} windows"
    for slower in (plan for plan, ratio in truth.items() if ratio > 1):
        assert kept.count(slower) / len(kept) <= 0.05, f"{slower} kept in {kept.count(slower)} of {len(kept)} windows"


def test_a_plan_must_be_measured_more_than_the_least_gain_faster_to_replace_the_default():
    for gain, kept in ((MIN_MEASURED_GAIN / 2, DEFAULT), (2 * MIN_MEASURED_GAIN, MORE)):
        trials = PlanTrials([DEFAULT, MORE], rounds=2)
        _run(trials, lambda plan, r, k: 10.0 * (1 - gain) if plan == MORE else 10.0)
        assert trials.fastest() == kept, f"{gain:.1%} faster"


def test_the_default_alone_has_nothing_to_time_against():
    trials = PlanTrials([DEFAULT], rounds=2)
    assert trials.schedule == [] and trials.done, "no step to spend on it"
    assert trials.fastest() == DEFAULT


def test_misuse_is_named():
    with pytest.raises(ValueError, match="distinct plans"):
        PlanTrials([DEFAULT, DEFAULT])
    with pytest.raises(ValueError, match="untimed step after its rebuild"):
        PlanTrials([DEFAULT, MORE], steps_per_trial=1)
