"""``bucket_cap_mb="auto"``: let the measured network choose the buckets.

torch's DDP buckets gradients with a fixed cap (25 MiB, the first bucket
1 MiB) whatever the network. The alpha-beta model (:mod:`minddp.net.network`)
says what the right cap depends on: every bucket pays the latency ``alpha``
once per ring step, and a bucket can only hide behind the backward compute
that is still to come when it is launched. A slow, high-latency link wants
few buckets; a fast link with compute to hide behind wants several, so that
most of the all-reduce happens while backward is still running.

MiniDDP already owns the pieces to decide this, so ``"auto"`` strings them
together once, early in training. :class:`AutoBuckets` is a policy that
drives the reducer from outside, through its narrow interface (the reducer
knows nothing of "auto"): it adds an arrival log to its observers, is called back at
the end of every backward, sends its probes with ``communicate_buffer`` and
finally calls ``rebuild``. :class:`~minddp.ddp.wrapper.MiniDDP` sets it up when
``bucket_cap_mb="auto"``.

1. **compute**: during a few synchronized backwards (after the first, which
   pays one-time costs and learns the gradient order), when each gradient is
   ready, in ms since the backward's first hook, and how long the step spends
   outside backward (optimizer, next forward). Medians over the steps make a
   :class:`~minddp.simulate.profile.ComputeProfile`;
2. **link**: a short probe (:mod:`minddp.net.link_probe`): all-reduces of
   two sizes through the very path the buckets take (the comm hook
   included, so a simulated link is measured as such), the fastest of a few
   tries each (load only adds time), fitted with
   :func:`minddp.net.network.fit_link`;
3. **costs** (:mod:`minddp.net.bucket_costs`), measured too: MiniDDP's own
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
4. **choice**: every candidate plan of :data:`CANDIDATE_CAPS_MB` replayed by
   :func:`minddp.simulate.simulate_step` with those costs; the smallest
   predicted step wins if it beats torch's default by more than the
   model's own error on the default's measured step (1% at least:
   :func:`leave_default_margin`), otherwise the default stays: a smaller
   predicted gain is within the error of what was measured.

Rank 0 decides and broadcasts its choice (as with the learned bucket order),
so every rank rebuilds the same buckets. :func:`choose_plan` is the pure
part, tested without any process group.

Limits: the gradient-ready times are host times. On a GPU a hook fires when
the gradient's kernels are *queued*, so the measured backward is the host's
run-ahead, not the device's work; the choice there is only as good as that
approximation (CUDA events per hook would fix it, at a cost every step).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from minddp.ddp.bucket_assignment import FIRST_BUCKET_CAP_MB, MiB
from minddp.net.bucket_costs import BucketCostLog, contention_us_per_MB, fixed_cost_us
from minddp.net.link_probe import communicate_buffer, fit_latency_bandwidth, timed
from minddp.net.network import Link
from minddp.simulate.overheads import NO_OVERHEADS, Overheads
from minddp.simulate.profile import ComputeProfile, Gradient
from minddp.simulate.replay import DDPPolicy, simulate_step
from minddp.ddp.placement import global_rank

__all__ = ["CANDIDATE_CAPS_MB", "LEAVE_DEFAULT_MARGIN", "MIN_LEAVE_DEFAULT_MARGIN", "MEASURED_BACKWARDS", "BucketChoice",
           "choose_plan", "leave_default_margin", "replay", "AutoBuckets"]

DEFAULT_CAP_MB = 25.0  # torch's
# Caps tried, each with torch's 1 MiB first bucket and with no smaller first
# bucket; one more candidate puts every gradient into a single bucket.
CANDIDATE_CAPS_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 64.0)
MEASURED_BACKWARDS = 3  # synchronized backwards measured, after the first one
PROBE_SMALL_BYTES = 64 * 1024
# Each probe is timed this many times and the fastest counts: load on the
# machine only ever adds time, so the fastest is the link's own (a median
# under load read a 0.05 ms link as several ms, and chose too few buckets).
PROBE_REPEATS = 5
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

    def describe(self) -> str:
        """The one line MiniDDP prints when it rebuilds its buckets."""
        choice = (f"MiniDDP bucket_cap_mb='auto': {self.buckets} bucket(s) (cap {self.cap_mb:g} MB, first "
                  f"{self.first_cap_mb:g} MB), predicted {self.predicted_ms:.1f} ms/step against {self.default_ms:.1f} "
                  f"ms for the default ({DEFAULT_CAP_MB:g} MB, first {FIRST_BUCKET_CAP_MB:g} MB: "
                  f"{self.default_buckets} bucket(s))")
        if self.passed_over is not None:
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
    step); torch's default unless that plan is predicted more than ``margin`` faster."""
    total_mb = profile.gradient_bytes / MiB
    candidates = [(DEFAULT_CAP_MB, FIRST_BUCKET_CAP_MB)]
    for cap in CANDIDATE_CAPS_MB:
        candidates += [(cap, min(cap, FIRST_BUCKET_CAP_MB)), (cap, cap)]
    everything = max(total_mb, DEFAULT_CAP_MB) * 2  # room for every gradient in one bucket
    candidates.append((everything, everything))
    results = []
    for order, plan in enumerate(candidates):
        step = simulate_step(profile, link, world_size, _policy(plan, costs))
        results.append((round(step.step_ms, 9), len(step.buckets), order, *plan))
    default = best = results[0]
    fastest = min(results)
    passed_over = None
    if fastest[0] < default[0] * (1 - margin):
        best = fastest
    elif fastest[0] < default[0]:
        passed_over = (fastest[1], fastest[0])
    return BucketChoice(best[3], best[4], best[1], best[0], default[0], default[1], link, costs, cpu_share,
                        passed_over, margin)


def leave_default_margin(measured_ms: float | None, modelled_ms: float) -> float:
    """How much faster than the default a plan must be predicted to replace it: the share of the default's
    measured step its replay got wrong, over or under (where the model explains the step, a small gain is
    real: 100 Mbit/s, 1.6% predicted, 2.5% measured), :data:`MIN_LEAVE_DEFAULT_MARGIN` at least."""
    if measured_ms is None:
        return LEAVE_DEFAULT_MARGIN
    return max(MIN_LEAVE_DEFAULT_MARGIN, abs(measured_ms - modelled_ms) / measured_ms)


def _policy(plan: tuple[float, float], costs: Overheads) -> DDPPolicy:
    """The buckets MiniDDP builds with caps ``plan`` (MB: every bucket, the first), charged ``costs``."""
    return DDPPolicy(*plan, overheads=costs, buckets_may_pass_cap=True)


def replay(profile: ComputeProfile, link: Link, world_size: int, plan: tuple[float, float],
           costs: Overheads = NO_OVERHEADS) -> float:
    """The step the model predicts for ``profile`` with the buckets of ``plan``, in ms."""
    return simulate_step(profile, link, world_size, _policy(plan, costs)).step_ms


# ----------------------------------------------------------- measuring it
class AutoBuckets:
    """``bucket_cap_mb="auto"`` on one reducer: measure a few backwards, probe, choose, rebuild once.

    Its life cycle: attached (the reducer records arrivals and calls
    :meth:`_after_backward` at the end of every backward), measuring (each
    call hands the arrivals to :meth:`backward_done`), deciding (once enough
    backwards are in: :meth:`decide` on every rank, since it runs
    collectives; rank 0's choice is broadcast and every rank rebuilds the
    same buckets), detached.
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
        self.decided = False
        self.choice: BucketChoice | None = None  # rank 0's, once decided

        self.arrivals = BucketCostLog()
        reducer.add_observer(self.arrivals)
        reducer.planned_rebuild = "MiniDDP(bucket_cap_mb='auto') rebuilds its buckets after its first measured steps"
        reducer.backward_done_callbacks.append(self._after_backward)

    @property
    def measuring(self) -> bool:
        return not self.decided

    def _after_backward(self) -> None:
        """The reducer's callback: record this backward; once enough are in, decide and rebuild."""
        reducer = self.reducer
        if not self.backward_done(self.arrivals.log, time.perf_counter(), self.arrivals.fills, self.arrivals.launches):
            return
        reducer.remove_observer(self.arrivals)
        reducer.backward_done_callbacks.remove(self._after_backward)
        group = reducer.process_group
        rank0 = global_rank(group, 0)
        is_rank0 = dist.get_rank() == rank0
        dtype = reducer.options.reduce_dtype or reducer.params[0].dtype
        choice, why = None, ""
        try:  # only rank 0 can fail here, after every probe collective: the broadcast below still matches
            choice = self.decide(functools.partial(communicate_buffer, reducer), reducer.world_size, reducer.device,
                                 dtype, is_rank0)
        except ValueError as error:
            why = str(error)
        caps = [choice.cap_mb, choice.first_cap_mb] if choice else [reducer.options.bucket_cap_mb,
                                                                    FIRST_BUCKET_CAP_MB]
        caps_t = torch.tensor(caps, dtype=torch.float64, device=reducer.device)
        dist.broadcast(caps_t, src=rank0, group=group)
        if is_rank0:
            print(choice.describe() if choice else f"MiniDDP bucket_cap_mb='auto': kept the default ({why})",
                  flush=True)
        cap_mb, first_mb = caps_t.tolist()
        reducer.planned_rebuild = None
        reducer.rebuild(reducer.bucket_order, int(cap_mb * MiB), int(first_mb * MiB))  # same order, new caps

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
        self.decided = True
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
                          source="measured by bucket_cap_mb='auto' (minddp/net/bucket_costs.py)")
        profile, measured = self.profile(), self.measured_step_ms()
        modelled = replay(profile, link, world_size, (DEFAULT_CAP_MB, FIRST_BUCKET_CAP_MB), costs)
        if measured is not None:  # what the replay misses, from the steps that ran with the default's buckets
            costs = replace(costs, per_step_ms=max(0.0, measured - modelled))
        margin = leave_default_margin(measured, modelled)
        self.choice = choose_plan(profile, link, world_size, costs, cpu_share, margin)
        return self.choice
