"""Bucket plans timed in turn on the real steps: the model proposes, the clock decides.

The replay that ``plan_buckets`` predicts with (:mod:`minddp_lab.auto.planner`)
explains a step over a slow link to within 1%, but on CPU ranks that share
their cores with Gloo it misses by 8% to 30%: how much an all-reduce beside
backward slows it, and how much of the wire backward still hides, are what
the model knows least, and exactly what decides between fewer buckets (less
latency, less contention) and more (more overlap). So the model proposes a
few plans (the default, its best on either side of it, one halfway to its
best with more), and :class:`PlanTrials` runs each for a block of real
steps, in turn, for a few rounds (the order rotating, so that no plan
always follows the same one):

* a block's first step rebuilds the buckets and touches their new buffers,
  so only the steps after it are timed;
* each plan is set against the default *in the same round*: the ratio of
  their blocks, whose median over the rounds is the plan's measured gain
  (a quiet or busy spell moves both);
* the plan with the lowest median ratio replaces the default if it is
  faster by more than :data:`MIN_MEASURED_GAIN`; otherwise the default
  stays.

Pure bookkeeping, no clock and no process group: the caller times each step
and rebuilds the buckets when :meth:`PlanTrials.step_done` says so; every
rank follows the same schedule, and rank 0's times decide.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

__all__ = ["MIN_MEASURED_GAIN", "STEPS_PER_TRIAL", "TRIAL_ROUNDS", "Plan", "PlanTrials", "Trial"]

Plan = tuple[float, float]  # (cap MB, first bucket's cap MB)

# Rounds of one block per plan. Replayed on long runs (docs/real_links.md), a plan more than 2% slower than
# the best is kept in 13% of the choices with 16 rounds, 8% with 32; but 32, measured on every link, did not
# lower mlp's ratio to torch's best cap on fast links, the pairs it was for, and doubled the trial steps.
TRIAL_ROUNDS = 16
STEPS_PER_TRIAL = 3  # a block: one step after the rebuild, untimed, then the timed ones
MIN_MEASURED_GAIN = 0.01  # a plan replaces the default only if measured more than 1% faster


@dataclass(frozen=True)
class Trial:
    """One plan's timed steps: their median, and its median ratio to the default's block in the same round."""

    plan: Plan
    median_ms: float
    ratio: float
    buckets: int = 0  # how many buckets the plan built (filled in by the caller, who saw them)


class PlanTrials:
    """The schedule of timed steps for ``plans`` (the first: the default), and the verdict."""

    def __init__(self, plans: list[Plan], rounds: int = TRIAL_ROUNDS, steps_per_trial: int = STEPS_PER_TRIAL):
        if len(set(plans)) != len(plans) or not plans:
            raise ValueError(f"PlanTrials needs distinct plans, the default first, got {plans}")
        if steps_per_trial < 2:
            raise ValueError("a block needs an untimed step after its rebuild and at least one timed step")
        self.plans, self.rounds, self.steps_per_trial = list(plans), rounds, steps_per_trial
        self.schedule: list[Plan] = []  # the plan of every trial step (the default alone: nothing to time)
        for r in range(rounds if len(plans) > 1 else 0):
            turn = self.plans[r % len(plans):] + self.plans[:r % len(plans)]  # the order rotates by one a round
            self.schedule += [plan for plan in turn for _ in range(steps_per_trial)]
        self.position = 0  # the step running now: schedule[position]
        self.blocks: dict[Plan, list[list[float]]] = {plan: [[] for _ in range(rounds)] for plan in plans}

    @property
    def done(self) -> bool:
        return self.position >= len(self.schedule)

    @property
    def current(self) -> Plan:
        """The plan the step running now was built with."""
        return self.schedule[self.position]

    def step_done(self, step_ms: float) -> Plan | None:
        """Record the step that just ended (``step_ms`` long); the plan to rebuild for the next one, or None
        (the same buckets again, or the trials are over)."""
        plan = self.current
        if self.position % self.steps_per_trial:  # not the block's first step: timed
            self.blocks[plan][self.position // (self.steps_per_trial * len(self.plans))].append(step_ms)
        self.position += 1
        if self.done or self.current == plan:
            return None
        return self.current

    def results(self) -> list[Trial]:
        """Every plan's median step and median ratio to the default over the rounds (the default's: 1)."""
        default = self.blocks[self.plans[0]]
        return [Trial(plan, statistics.median(t for block in blocks for t in block),
                      statistics.median(statistics.mean(b) / statistics.mean(d) for b, d in zip(blocks, default)))
                for plan, blocks in self.blocks.items()]

    def fastest(self) -> Plan:
        """The plan with the lowest median ratio if it beats the default by more than
        :data:`MIN_MEASURED_GAIN`; else the default."""
        if len(self.plans) == 1:
            return self.plans[0]
        best = min(self.results(), key=lambda trial: trial.ratio)
        return best.plan if best.ratio < 1 - MIN_MEASURED_GAIN else self.plans[0]
