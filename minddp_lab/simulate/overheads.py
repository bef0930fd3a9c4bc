"""The costs a bare alpha-beta replay misses, each a named number.

The replay of :mod:`minddp_lab.simulate.replay` treats communication that
overlaps backward as free and DDP itself as costing nothing. Measured on
GPUs, neither is true (PyTorch's own DDP benchmark: 1 GPU with DDP is
1-6% slower than without; going to 2 GPUs costs 2-4% more, although every
all-reduce hides under backward). :class:`Overheads` names five costs:

* ``per_step_ms``: the wrapper's own work once per step, before forward and
  after backward (preparing the reducer, finishing the step);
* ``per_gradient_us``: the work of each gradient's hook (mark it ready,
  copy it into its bucket), on the compute stream: backward waits for it;
* ``per_bucket_us``: launching each bucket's collective and copying the
  result back, also on the compute stream;
* ``contention_us_per_MB``: compute that a collective running beside
  backward takes from it, per MB the rank sends (on a GPU, NCCL's kernels
  run on the same SMs and memory as backward's). While the collective runs,
  backward slows by that much spread over the collective's duration;
  once backward is over, nothing is left to slow;
* ``compute_slowdown``: from the first collective's launch to the end of
  backward, backward runs ``1 + compute_slowdown`` times slower (on a GPU
  NCCL's kernels sit on SMs from launch, waiting for the data or the peers;
  at world size 1 there is nothing to wait for).

Every cost is paid at any world size, one included: DDP on one rank still
hooks, buckets and launches (its all-reduce is a copy). With all five at
zero (:data:`NO_OVERHEADS`, the API's default) the replay is the bare model.
:data:`OVERHEAD_PRESETS` holds figures with their source;
``benchmarks/published_ddp.py`` fits ``nccl-v100`` to part of PyTorch's
published DDP table and checks it on the rest.

:class:`ComputeClock` turns "backward has done ``c`` ms of its own work"
into wall time, given the intervals in which a collective slowed it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["Overheads", "NO_OVERHEADS", "OVERHEAD_PRESETS", "get_overheads", "ComputeClock"]


@dataclass(frozen=True)
class Overheads:
    per_step_ms: float = 0.0
    per_gradient_us: float = 0.0
    per_bucket_us: float = 0.0
    contention_us_per_MB: float = 0.0  # MB = 1e6 bytes sent by this rank
    compute_slowdown: float = 0.0  # backward's speed / (1 + this) once collectives are in flight
    source: str = "none: the bare alpha-beta replay"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"overheads: {f.name} must be a number >= 0, got {value!r}")

    def describe(self) -> str:
        return (f"{self.per_step_ms:g} ms per step, {self.per_gradient_us:g} us per gradient, "
                f"{self.per_bucket_us:g} us per bucket, compute slowed by {self.contention_us_per_MB:g} us "
                f"per MB a collective sends beside backward, and by {self.compute_slowdown:.1%} once collectives "
                f"are in flight ({self.source})")


NO_OVERHEADS = Overheads()

OVERHEAD_PRESETS: dict[str, Overheads] = {
    "none": NO_OVERHEADS,
    # Fitted by `python benchmarks/published_ddp.py --fit` to resnet50 and resnext101_32x8d of PyTorch's DDP
    # benchmark (benchmarks/distributed/ddp/README.md in pytorch/pytorch: DGX-1, V100, NCCL, torch 1.4);
    # resnet101 and resnext50_32x4d held out. See docs/simulator_checked.md.
    "nccl-v100": Overheads(per_step_ms=2.0, per_gradient_us=10.0, per_bucket_us=20.0, contention_us_per_MB=5.0,
                           compute_slowdown=0.06,
                           source="fitted to PyTorch's published DDP benchmark, DGX-1 V100, torch 1.4 "
                                  "(benchmarks/published_ddp.py)"),
}


def get_overheads(name: str) -> Overheads:
    try:
        return OVERHEAD_PRESETS[name]
    except KeyError:
        raise ValueError(f"--overheads must be one of {', '.join(OVERHEAD_PRESETS)}, got {name!r}") from None


class ComputeClock:
    """Backward's progress in wall time, when collectives running beside it slow it down.

    ``slow(start, end, rate)``: between those wall times backward does
    ``rate`` ms of its work per ms (0: stopped, as on a CPU whose cores the
    collective takes; 1: untouched). Intervals are added in time order and
    do not overlap (one collective on the wire at a time). ``slow_from(t,
    rate)``: from ``t`` on, every rate is multiplied by ``rate`` too.
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float, float]] = []
        self.base_from, self.base_rate = math.inf, 1.0

    @property
    def busy_until(self) -> float:
        """The end of the last interval (0 if none)."""
        return self.intervals[-1][1] if self.intervals else 0.0

    def slow(self, start: float, end: float, rate: float) -> None:
        if start < self.busy_until:
            raise ValueError(f"slowing intervals must not overlap: {start} starts before {self.busy_until}")
        if end > start and rate < 1.0:
            self.intervals.append((start, end, max(0.0, rate)))

    def slow_from(self, start: float, rate: float) -> None:
        if self.base_from == math.inf and rate < 1.0:
            self.base_from, self.base_rate = start, max(0.0, rate)

    def _segments(self):
        """(start, end, rate) pieces covering [0, inf), in order."""
        cuts = sorted({0.0, self.base_from, *(t for s, e, _ in self.intervals for t in (s, e))} - {math.inf})
        inside = {s: r for s, _, r in self.intervals}
        ends = {e for _, e, _ in self.intervals}
        rate_here = 1.0
        for a, b in zip(cuts, [*cuts[1:], math.inf]):
            if a in inside:
                rate_here = inside[a]
            elif a in ends:
                rate_here = 1.0
            yield a, b, rate_here * (self.base_rate if a >= self.base_from else 1.0)

    def wall(self, work_ms: float) -> float:
        """When backward has done ``work_ms`` of its own work (ms since it began)."""
        done = 0.0
        for a, b, rate in self._segments():
            if rate > 0 and done + (b - a) * rate >= work_ms:
                return a + (work_ms - done) / rate
            done += (b - a) * rate
        return math.inf  # stopped for good: cannot happen with a finite interval list

    def lost_ms(self, until_ms: float) -> float:
        """Wall time lost to slowing before ``until_ms``."""
        return sum((min(b, until_ms) - a) * (1 - rate) for a, b, rate in self._segments() if a < until_ms)
