"""``plan_buckets``: let the measured network choose the buckets.

torch's DDP buckets gradients with a fixed cap (25 MiB, the first bucket
1 MiB) whatever the network. The alpha-beta model (:mod:`minddp_lab.network`)
says what the right cap depends on: every bucket pays the latency ``alpha``
once per ring step, and a bucket can only hide behind the backward compute
that is still to come when it is launched. A slow, high-latency link wants
few buckets; a fast link with compute to hide behind wants several, so that
most of the all-reduce happens while backward is still running.

MiniDDP already owns the pieces to decide this, so ``"auto"`` strings them
together once, early in training: the policy on the reducer,
:class:`~minddp_lab.auto.policy.AutoBuckets`, measures (1 to 3 below),
this module's model proposes (4), and :mod:`minddp_lab.auto.trials` times
the proposals in turn and keeps the fastest (5).

1. **compute**: during a few synchronized backwards (after the first, which
   pays one-time costs and learns the gradient order), when each gradient is
   ready, in ms since the backward's first hook, and how long the step spends
   outside backward (optimizer, next forward). Medians over the steps make a
   :class:`~minddp_lab.simulate.profile.ComputeProfile`;
2. **link**: a short probe (:mod:`minddp_lab.links.probe`): all-reduces of
   two sizes through the very path the buckets take (the comm hook
   included, so a simulated link is measured as such), the fastest of a few
   tries each (load only adds time), fitted with
   :func:`minddp_lab.network.fit_link`;
3. **costs** (:mod:`minddp_lab.auto.costs`), measured too: MiniDDP's own
   work per bucket (the fill's fixed part and the launch, timed in the
   measured backwards), since backward waits for it; and the CPU an
   all-reduce beside backward takes from it, per MB sent, from the CPU time
   this process spent during the probe's largest all-reduces (zero on a GPU
   or with a core to spare per rank). The second is charged continuously:
   Gloo over loopback keeps the CPU busy 0.2 to 0.9 of an all-reduce (2
   ranks on 2 cores, under load), a 1 Gbit/s link between network
   namespaces 0.07 to 0.15; the replay slows backward by that share while a
   bucket is on the wire, so a partly busy all-reduce still hides the rest;
   and what the replay still misses: the measured steps ran with the
   default's buckets, so their median step against the default's replay is
   what the model leaves out there (waiting for the slower rank, the end of
   backward, an all-reduce slower in a step than in the probe). That rest
   is charged to every plan once per step (``Overheads.per_step_ms``): the
   default's prediction is its measured step, and every other plan is
   predicted from there;
4. **proposals**: every candidate plan of :data:`CANDIDATE_CAPS_MB` replayed by
   :func:`minddp_lab.simulate.simulate_step` with those costs (:func:`choose_plan`,
   pure, tested without any process group). Its pick, the smallest
   predicted step, counts if it beats torch's default by more than the
   model's own error on the default's measured step (1% at least:
   :func:`leave_default_margin`); what it proposes for timing is the
   default, its best plan with fewer buckets and with more, and one halfway
   between the default and that best (the model undercounts what a bucket
   costs where ranks wait for a core), each unless predicted slower than
   the default by more than that error;
5. **the clock**: the proposals run in turn on real steps, and the fastest
   measured is kept (:mod:`minddp_lab.auto.trials`).

Rank 0 decides and broadcasts (as with the learned bucket order), so every
rank rebuilds the same buckets.

Limits: the gradient-ready times are host times. On a GPU a hook fires when
the gradient's kernels are *queued*, so the measured backward is the host's
run-ahead, not the device's work; the choice there is only as good as that
approximation (CUDA events per hook would fix it, at a cost every step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minddp.ddp.core.assignment import FIRST_BUCKET_CAP_MB, MiB
from minddp_lab.network import Link
from minddp_lab.auto.trials import MIN_MEASURED_GAIN, Plan, Trial
from minddp_lab.simulate.overheads import NO_OVERHEADS, Overheads
from minddp_lab.simulate.profile import ComputeProfile
from minddp_lab.simulate.replay import DDPPolicy, simulate_step

__all__ = ["CANDIDATE_CAPS_MB", "DEFAULT_CAP_MB", "MAX_PROPOSALS", "LEAVE_DEFAULT_MARGIN", "MIN_LEAVE_DEFAULT_MARGIN",
           "BucketChoice", "choose_plan", "leave_default_margin", "plan_policy", "replay"]

DEFAULT_CAP_MB = 25.0  # torch's
MAX_PROPOSALS = 4  # plans timed: the default, the best with fewer buckets, the best with more, one halfway to it
# Caps tried, each with torch's 1 MiB first bucket and with no smaller first
# bucket; one more candidate puts every gradient into a single bucket.
CANDIDATE_CAPS_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 64.0)
# A plan must beat the default by more than the model's error on the default's measured step (smaller gains
# flipped the choice from run to run under load; leave_default_margin): 1% at least, 2% if nothing was measured.
MIN_LEAVE_DEFAULT_MARGIN, LEAVE_DEFAULT_MARGIN = 0.01, 0.02


@dataclass(frozen=True)
class BucketChoice:
    """The plan chosen, and why: predicted step times of it and of torch's default."""

    cap_mb: float
    first_cap_mb: float
    buckets: int
    predicted_ms: float
    default_ms: float
    default_buckets: int
    link: Link
    costs: Overheads = NO_OVERHEADS  # charged beyond the wire: per bucket, backward's CPU per MB sent, per step
    cpu_share: float | None = None  # how busy this process's CPU was during the link probe's all-reduces
    passed_over: tuple[int, float] | None = None  # (buckets, predicted ms) of a faster plan not faster by the margin
    margin: float = LEAVE_DEFAULT_MARGIN  # how much faster than the default a plan had to be predicted
    contenders: tuple[Plan, ...] = ()  # to time in turn: the default, the best with fewer and more buckets, one halfway
    trials: tuple[Trial, ...] = ()  # once they ran (minddp_lab.auto.trials): the kept plan is the measured fastest

    def describe(self) -> str:
        """The one line MiniDDP prints when it rebuilds its buckets."""
        choice = (f"MiniDDP plan_buckets: {self.buckets} bucket(s) (cap {self.cap_mb:g} MB, first "
                  f"{self.first_cap_mb:g} MB), predicted {self.predicted_ms:.1f} ms/step against {self.default_ms:.1f} "
                  f"ms for the default ({DEFAULT_CAP_MB:g} MB, first {FIRST_BUCKET_CAP_MB:g} MB: "
                  f"{self.default_buckets} bucket(s))")
        if self.trials:
            default, *others = self.trials
            timed = ", ".join(f"{t.buckets} bucket(s) {t.median_ms:.1f} ms ({t.ratio:.3f} of it)" for t in others)
            choice += (f"; timed in turn, median step: the default {default.median_ms:.1f} ms, {timed}; "
                       f"kept the fastest if more than {MIN_MEASURED_GAIN:.0%} faster")
        elif self.passed_over is not None:
            buckets, ms = self.passed_over
            choice += f", kept: the fastest plan, {buckets} bucket(s) at {ms:.1f} ms, is not {self.margin:.0%} faster"
        busy = "" if self.cpu_share is None else f" (busy {self.cpu_share:.0%} of a probe all-reduce)"
        return "; ".join([
            choice,
            f"measured link alpha {self.link.alpha_s * 1e3:.3f} ms, {self.link.bandwidth_Bps / 1e9:.3g} GB/s",
            f"MiniDDP's own work {self.costs.per_bucket_us:.0f} us per bucket",
            f"an all-reduce beside backward takes {self.costs.contention_us_per_MB:.0f} us of its CPU per MB "
            f"sent{busy}",
            f"the default's measured step {self.costs.per_step_ms:.1f} ms longer than the model's, added to every plan",
        ])


def choose_plan(profile: ComputeProfile, link: Link, world_size: int, costs: Overheads = NO_OVERHEADS,
                cpu_share: float | None = None, margin: float = LEAVE_DEFAULT_MARGIN) -> BucketChoice:
    """The candidate bucket plan with the smallest predicted step (fewer buckets on a tie), each replayed with
    ``costs`` (MiniDDP's work per bucket, backward's CPU per MB on the wire beside it, what the model misses per
    step); torch's default unless that plan is predicted more than ``margin`` faster. Its ``contenders``: the
    plans worth timing on real steps (:mod:`minddp_lab.auto.trials`)."""
    total_mb = profile.gradient_bytes / MiB
    candidates = [(DEFAULT_CAP_MB, FIRST_BUCKET_CAP_MB)]
    for cap in CANDIDATE_CAPS_MB:
        candidates += [(cap, min(cap, FIRST_BUCKET_CAP_MB)), (cap, cap)]
    everything = max(total_mb, DEFAULT_CAP_MB) * 2  # room for every gradient in one bucket
    candidates.append((everything, everything))
    results = []
    for order, plan in enumerate(candidates):
        step = simulate_step(profile, link, world_size, plan_policy(plan, costs))
        results.append((round(step.step_ms, 9), len(step.buckets), order, *plan))
    default = best = results[0]
    fastest = min(results)
    passed_over = None
    if fastest[0] < default[0] * (1 - margin):
        best = fastest
    elif fastest[0] < default[0]:
        passed_over = (fastest[1], fastest[0])
    # Worth timing (minddp_lab.auto.trials): the best plan with fewer buckets than the default and the best
    # with more (the model's pick is one of them, unless it only splits the default's count differently), each
    # unless predicted slower than the default by more than the model's error: a loss that large it can see.
    worth_timing = [r for r in results if r[0] <= default[0] * (1 + margin)]
    fewer = [r for r in worth_timing if r[1] < default[1]]
    more = [r for r in worth_timing if r[1] > default[1]]
    timed = [default] + [min(side) for side in (fewer, more) if side]
    # And a plan halfway (on a log scale) between the default's number of buckets and that best's: MiniDDP's
    # cost per bucket is measured as CPU time, not the wait for a core, so where ranks share cores the model's
    # best with more buckets has too many (4 ranks on 2 cores, gpt: it proposed 7 or 13, where 4 buckets were
    # 3% to 5% faster than the default).
    if more:
        halfway = math.sqrt(default[1] * min(more)[1])
        middle = min(more, key=lambda r: (abs(math.log(r[1] / halfway)), r[0]))
        if middle not in timed:
            timed.append(middle)
    contenders = tuple(tuple(r[3:]) for r in timed)
    return BucketChoice(best[3], best[4], best[1], best[0], default[0], default[1], link, costs, cpu_share,
                        passed_over, margin, contenders)


def leave_default_margin(measured_ms: float | None, modelled_ms: float) -> float:
    """How much faster than the default a plan must be predicted to replace it: the share of the default's
    measured step its replay got wrong, over or under (where the model explains the step, a small gain is
    real: 100 Mbit/s, 1.6% predicted, 2.5% measured), :data:`MIN_LEAVE_DEFAULT_MARGIN` at least."""
    if measured_ms is None:
        return LEAVE_DEFAULT_MARGIN
    return max(MIN_LEAVE_DEFAULT_MARGIN, abs(measured_ms - modelled_ms) / measured_ms)


def plan_policy(plan: Plan, costs: Overheads) -> DDPPolicy:
    """The buckets MiniDDP builds with caps ``plan`` (MB: every bucket, the first), charged ``costs``."""
    return DDPPolicy(*plan, overheads=costs, buckets_may_pass_cap=True)


def replay(profile: ComputeProfile, link: Link, world_size: int, plan: tuple[float, float],
           costs: Overheads = NO_OVERHEADS) -> float:
    """The step the model predicts for ``profile`` with the buckets of ``plan``, in ms."""
    return simulate_step(profile, link, world_size, plan_policy(plan, costs)).step_ms
