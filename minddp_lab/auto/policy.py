""":func:`plan_buckets` on a built MiniDDP: measure, probe, propose, time in turn, rebuild.

:class:`AutoBuckets` is a policy that drives the reducer from outside,
through its narrow interface (the reducer knows nothing of "auto"): it adds
an arrival log to its observers, is called back at the end of every
backward, sends its probes with ``communicate_buffer``, rebuilds the buckets
for each plan it times and finally for the one it keeps.
:func:`plan_buckets` attaches it to a :class:`~minddp.ddp.wrapper.MiniDDP`.
The model it predicts with is :mod:`minddp_lab.auto.planner`; the timing
of its contenders, :mod:`minddp_lab.auto.trials`.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
import weakref
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from minddp.ddp.core.assignment import FIRST_BUCKET_CAP_MB, MiB
from minddp.ddp.policies import Policy, add_policy, remove_policy
from minddp.ddp.placement import global_rank
from minddp_lab.auto.costs import BucketCostLog, contention_us_per_MB, fixed_cost_us
from minddp_lab.auto.planner import (CANDIDATE_CAPS_MB, DEFAULT_CAP_MB, MAX_PROPOSALS, BucketChoice, choose_plan,
                                       leave_default_margin, plan_policy, replay)
from minddp_lab.links.probe import communicate_buffer, fit_latency_bandwidth, timed
from minddp_lab.auto.trials import STEPS_PER_TRIAL, TRIAL_ROUNDS, Plan, PlanTrials
from minddp_lab.simulate.overheads import Overheads
from minddp_lab.simulate.profile import ComputeProfile, Gradient
from minddp_lab.simulate.replay import simulate_step

__all__ = ["MEASURED_BACKWARDS", "SETTLING_BACKWARDS", "AutoBuckets", "plan_buckets", "planner_of"]

MEASURED_BACKWARDS = 3  # synchronized backwards measured, after the first one
# At most this many synchronized backwards before the buckets are final: the first, the measured ones, and
# the proposals' trials; the next forward builds the kept plan.
SETTLING_BACKWARDS = 1 + MEASURED_BACKWARDS + MAX_PROPOSALS * TRIAL_ROUNDS * STEPS_PER_TRIAL
PROBE_SMALL_BYTES = 64 * 1024
# Each probe is timed this many times and the fastest counts: load on the
# machine only ever adds time, so the fastest is the link's own (a median
# under load read a 0.05 ms link as several ms, and chose too few buckets).
PROBE_REPEATS = 5


class AutoBuckets(Policy):
    """``plan_buckets`` on one reducer: measure a few backwards, probe, propose, time, rebuild.

    Its life cycle: attached (the reducer records arrivals and calls
    :meth:`after_backward` at the end of every backward), measuring (each
    call hands the arrivals to :meth:`backward_done`), proposing (once enough
    backwards are in: :meth:`decide` on every rank, since it runs
    collectives; rank 0's contenders are broadcast), timing them in turn
    (:class:`~minddp_lab.auto.trials.PlanTrials`: every rank rebuilds the
    same plans at the same steps), settled (rank 0's verdict is broadcast,
    every rank rebuilds the same buckets), detached.
    """

    def __init__(self, reducer):
        self.reducer = reducer
        dtypes = [reducer.options.reduce_dtype or p.dtype for p in reducer.params]
        self.names, self.dtypes = reducer.names, dtypes
        self.nbytes = [p.numel() * dtype.itemsize for p, dtype in zip(reducer.params, dtypes)]
        self.backwards_seen = 0
        self._ready_ms: list[list[float]] = [[] for _ in self.names]
        self._outside_ms: list[float] = []  # end of one backward to the first hook of the next
        self._inside_ms: list[float] = []  # first hook of a backward to its end (gradients written)
        self._fills: list[tuple[int, float]] = []  # (bytes, seconds) of every bucket filled in the measured ones
        self._launches: list[float] = []
        self._last_finished: float | None = None
        self.choice: BucketChoice | None = None  # rank 0's, once decided (with the trials' verdict once settled)
        self.trials: PlanTrials | None = None  # the contenders timed in turn, once proposed
        self.settled = False
        self._buckets_of: dict[Plan, int] = {}  # how many buckets each timed plan built
        self._trial_clock = 0.0  # when the last trial step ended (perf_counter)

        self.arrivals = BucketCostLog()
        reducer.add_observer(self.arrivals)
        add_policy(reducer, self)

    def backwards_until_final(self) -> int | None:
        return 0 if self.settled else None  # the plan is timed over the first steps: how many, it decides

    def after_backward(self) -> None:
        """The reducer's callback: record this backward; once enough are in, propose; then time each step."""
        if self.trials is not None:
            return self._trial_step_done()
        reducer = self.reducer
        if not self.backward_done(self.arrivals.log, time.perf_counter(), self.arrivals.fills, self.arrivals.launches):
            return
        reducer.remove_observer(self.arrivals)
        dtype = reducer.options.reduce_dtype or reducer.params[0].dtype
        why = ""
        try:  # only rank 0 can fail here, after every probe collective: the broadcast below still matches
            self.decide(functools.partial(communicate_buffer, reducer), reducer.world_size, reducer.device,
                        dtype, self._is_rank0)
        except ValueError as error:
            why = f"MiniDDP plan_buckets: kept the default ({error})"
        default = (reducer.options.bucket_cap_mb, FIRST_BUCKET_CAP_MB)
        proposed = list(self.choice.contenders) if self.choice else [default]
        plans = self._from_rank0(proposed + [(math.nan, math.nan)] * (MAX_PROPOSALS - len(proposed)))
        self.trials = PlanTrials([plan for plan in plans if not math.isnan(plan[0])])
        if len(self.trials.plans) == 1:  # nothing to time against the default
            return self._settle(why)
        self._rebuild(self.trials.current)
        self._trial_clock = time.perf_counter()  # (the probe's time is not a step's)

    def _trial_step_done(self) -> None:
        now = time.perf_counter()
        self._buckets_of[self.trials.current] = len(self.reducer.buckets)
        rebuild_for = self.trials.step_done((now - self._trial_clock) * 1e3)
        self._trial_clock = now
        if self.trials.done:
            self._settle()
        elif rebuild_for is not None:
            self._rebuild(rebuild_for)

    def _settle(self, why: str = "") -> None:
        """Rank 0's verdict to every rank, its line printed, the kept plan rebuilt, the planner detached."""
        trials = self.trials
        if self.choice is not None:  # rank 0
            kept = trials.fastest()
            results = tuple(replace(trial, buckets=self._buckets_of.get(trial.plan, 0)) for trial in trials.results()
                            ) if len(trials.plans) > 1 else ()
            step = simulate_step(self.profile(), self.choice.link, self.reducer.world_size,
                                 plan_policy(kept, self.choice.costs))
            self.choice = replace(self.choice, cap_mb=kept[0], first_cap_mb=kept[1], buckets=len(step.buckets),
                                  predicted_ms=step.step_ms, trials=results)
        (kept,) = self._from_rank0([(self.choice.cap_mb, self.choice.first_cap_mb) if self.choice else trials.plans[0]])
        if self._is_rank0:
            print(self.choice.describe() if self.choice else why, flush=True)
        remove_policy(self.reducer, self)
        self.settled = True
        if kept != (trials.schedule[-1] if trials.schedule else trials.plans[0]):  # what the last step built
            self._rebuild(kept)

    def _rebuild(self, plan: Plan) -> None:
        """The same order, ``plan``'s caps, from the next synchronized forward."""
        self.reducer.rebuild(self.reducer.bucket_order, int(plan[0] * MiB), int(plan[1] * MiB))

    @property
    def _is_rank0(self) -> bool:
        return dist.get_rank() == global_rank(self.reducer.process_group, 0)

    def _from_rank0(self, plans: list[Plan]) -> list[Plan]:
        """Rank 0's ``plans`` (the same number on every rank), on every rank."""
        sent = torch.tensor(plans, dtype=torch.float64, device=self.reducer.device)
        dist.broadcast(sent, src=global_rank(self.reducer.process_group, 0), group=self.reducer.process_group)
        return [tuple(plan) for plan in sent.tolist()]

    def backward_done(self, arrivals: list[tuple[int, float]], finished: float,
                      fills: list[tuple[int, float]] = (), launches: list[float] = ()) -> bool:
        """Record one backward (its arrivals, and its buckets' fills and launches); True when it is time to decide.

        Counted the same on every rank (a joined rank's stand-in steps, with
        no arrivals, count too), since deciding runs collectives.
        """
        self.backwards_seen += 1
        if self.backwards_seen > 1 and arrivals:  # the first: one-time costs, order still provisional
            started = arrivals[0][1]
            for index, t in arrivals:
                self._ready_ms[index].append((t - started) * 1e3)
            if self._last_finished is not None:
                self._outside_ms.append((started - self._last_finished) * 1e3)
            self._inside_ms.append((finished - started) * 1e3)
            self._fills += fills
            self._launches += launches
        self._last_finished = finished
        return self.backwards_seen > MEASURED_BACKWARDS

    def profile(self) -> ComputeProfile:
        """The median measured step, with the network taken out."""
        medians = [statistics.median(ts) if ts else None for ts in self._ready_ms]
        last = max((m for m in medians if m is not None), default=0.0)
        gradients = [  # a parameter that never got a gradient: counted as ready at the end
            Gradient(name, last if m is None else m, n, str(dtype))
            for name, m, n, dtype in zip(self.names, medians, self.nbytes, self.dtypes)
        ]
        outside = statistics.median(self._outside_ms) if self._outside_ms else 0.0
        return ComputeProfile(outside, sorted(gradients, key=lambda g: g.ready_ms), 0.0)

    def measured_step_ms(self) -> float | None:
        """The median measured step with the default's buckets, their communication included (None: none measured)."""
        if not (self._inside_ms and self._outside_ms):
            return None
        return statistics.median(self._inside_ms) + statistics.median(self._outside_ms)

    def decide(self, communicate: Callable[[torch.Tensor], torch.futures.Future], world_size: int,
               device: torch.device, dtype: torch.dtype, is_rank0: bool) -> BucketChoice | None:
        """Probe the link and the CPU its all-reduces take (every rank: collectives), choose (rank 0 only)."""
        # The large probe: every gradient's bytes, up to the largest candidate cap (past tens of MB it only
        # measures the same bandwidth, and on a large model it would be a third copy of the gradients).
        large = min(sum(self.nbytes), int(max(CANDIDATE_CAPS_MB) * MiB))
        sizes = [PROBE_SMALL_BYTES, max(large, 2 * PROBE_SMALL_BYTES)]
        element = torch.empty((), dtype=dtype).element_size()
        buffers = [torch.zeros(n // element, dtype=dtype, device=device) for n in sizes]
        timings = [[timed(communicate, b) for _ in range(PROBE_REPEATS)] for b in buffers]
        seconds = [min(wall for wall, _ in t) for t in timings]
        cpu_share = statistics.median(cpu / wall for wall, cpu in timings[-1])  # the largest all-reduces
        if not is_rank0:
            return None
        link = fit_latency_bandwidth([float(b.nbytes) for b in buffers], seconds, world_size)
        costs = Overheads(per_bucket_us=fixed_cost_us(self._fills, self._launches),
                          contention_us_per_MB=contention_us_per_MB(
                              device, world_size, statistics.median(cpu for _, cpu in timings[-1]), buffers[-1].nbytes),
                          source="measured by plan_buckets (minddp_lab/auto/costs.py)")
        profile, measured = self.profile(), self.measured_step_ms()
        modelled = replay(profile, link, world_size, (DEFAULT_CAP_MB, FIRST_BUCKET_CAP_MB), costs)
        if measured is not None:  # what the replay misses, from the steps that ran with the default's buckets
            costs = replace(costs, per_step_ms=max(0.0, measured - modelled))
        margin = leave_default_margin(measured, modelled)
        self.choice = choose_plan(profile, link, world_size, costs, cpu_share, margin)
        return self.choice


def plan_buckets(ddp_model) -> AutoBuckets | None:
    """Let the first steps choose ``ddp_model``'s buckets: measure, probe the link, propose, time, rebuild.

    Call it on every rank, right after ``MiniDDP(...)`` and before the first
    backward (the planner runs collectives from the end of a backward, so every
    rank must have one). The plan it times against is the model's own cap
    (25 MiB, the first bucket 1 MiB, by default). Alone (world size 1) there is
    nothing to plan: None. :func:`planner_of` finds it again; a copy or a
    reloaded pickle of the model has none.
    """
    reducer = getattr(ddp_model, "reducer", None)
    if reducer is None or not hasattr(reducer, "observers"):
        raise TypeError(f"plan_buckets needs a minddp.MiniDDP, got {type(ddp_model).__name__}")
    if planner_of(ddp_model) is not None:
        raise ValueError("plan_buckets: this MiniDDP already has a bucket planner (call plan_buckets once)")
    if ddp_model.bucket_cap_mb_list is not None:
        raise ValueError("plan_buckets chooses the caps itself: build the MiniDDP without bucket_cap_mb_list")
    if reducer.world_size == 1:
        return None
    planner = AutoBuckets(reducer)
    _PLANNERS[ddp_model] = planner
    return planner


_PLANNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # MiniDDP -> its planner


def planner_of(ddp_model) -> AutoBuckets | None:
    """The planner :func:`plan_buckets` gave ``ddp_model`` (it stays, settled, after the plan is kept); None."""
    return _PLANNERS.get(ddp_model)
