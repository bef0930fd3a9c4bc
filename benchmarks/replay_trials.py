"""How often ``auto``'s trials keep a slower plan, replayed on block times that ``auto_vs_caps.py`` measured.

    python benchmarks/replay_trials.py RUNS.json --rounds 4,8,16    (RUNS.json: written by auto_vs_caps.py --json)

``bucket_cap_mb="auto"`` times its proposals for a few rounds of short
blocks (:class:`minddp.net.plan_trials.PlanTrials`) and keeps the fastest;
on 2 shared cores a block's time moves by 5% to 20% from round to round, so
a few rounds can keep a plan that is slower. How much that costs, and what
more rounds would buy, can be read from a long ``auto_vs_caps.py`` run,
which times torch's DDP at every cap in the same rounds: here torch's caps
stand in for the plans (torch's default for the default, every other cap a
proposal). For each model and run, windows of ``R`` consecutive rounds are
fed, block by block, to :class:`PlanTrials` itself (each block's time per
step for its timed steps), and the plan it keeps is charged its true
ratio, its median ratio to the default over *all* the run's rounds,
against the best cap's: the cost of the choice. Reported per ``R``: the
mean cost over windows, models and runs, and the share of choices more
than 2% slower than the best (the target of docs/real_links.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from minddp.net.plan_trials import STEPS_PER_TRIAL, TRIAL_ROUNDS, PlanTrials

from auto_vs_caps import TARGET
from benchlib.wrappers import DEFAULT_CAP_MB

DEFAULT = f"torch@{DEFAULT_CAP_MB:g}"  # torch's default (auto_vs_caps.py's name): what auto's default plan stands for


def true_ratio(blocks: dict[str, list[float]], name: str) -> float:
    """``name``'s median ratio to the default over every round of the run."""
    return statistics.median(a / d for a, d in zip(blocks[name], blocks[DEFAULT]))


def kept(blocks: dict[str, list[float]], names: list[str], first_round: int, rounds: int) -> str:
    """The plan :class:`PlanTrials` keeps, fed rounds ``first_round`` to ``first_round + rounds - 1``."""
    plans = [(float(i), 0.0) for i in range(len(names))]  # PlanTrials' plans are (cap, first cap) pairs
    trials, name_of = PlanTrials(plans, rounds=rounds), dict(zip(plans, names))
    while not trials.done:
        r = first_round + trials.position // (STEPS_PER_TRIAL * len(plans))
        trials.step_done(blocks[name_of[trials.current]][r])
    return name_of[trials.fastest()]


def costs(blocks: dict[str, list[float]], rounds: int) -> list[float]:
    """The cost of the plan kept, every window of ``rounds`` consecutive rounds of one run."""
    names = [DEFAULT] + [n for n in blocks if n.startswith("torch@") and n != DEFAULT]
    truth = {n: true_ratio(blocks, n) for n in names}
    best = min(truth.values())
    n_rounds = len(blocks[DEFAULT])
    return [truth[kept(blocks, names, start, rounds)] / best - 1 for start in range(n_rounds - rounds + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="files auto_vs_caps.py wrote with --json")
    parser.add_argument("--rounds", default="4,8,16", help=f"trial rounds to replay (auto's: {TRIAL_ROUNDS})")
    args = parser.parse_args()
    print("| file | trial rounds | mean cost of the plan kept | kept more than 2% slower than the best |")
    print("|---|---|---|---|")
    for path in args.json:
        with open(path) as f:
            runs = json.load(f)["runs"]
        for rounds in map(int, args.rounds.split(",")):
            every = [c for run in runs for model in run.values() for c in costs(model["block_ms"], rounds)]
            if not every:
                sys.exit(f"{path}: fewer than {rounds} rounds a run")
            share = sum(1 + c > TARGET for c in every) / len(every)  # kept more than 2% slower than the best
            print(f"| {os.path.basename(path)} | {rounds} | {100 * statistics.mean(every):.2f}% | {100 * share:.0f}% |")


if __name__ == "__main__":
    main()
