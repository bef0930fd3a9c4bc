"""The costs a bare alpha-beta replay misses, each a named number.

The replay of :mod:`minddp.simulate.replay` treats communication that
overlaps backward as free and DDP itself as costing nothing. Measured on
GPUs, neither is true (PyTorch's own DDP benchmark: 1 GPU with DDP is
2-6% slower than without; going to 2 GPUs costs 3% more, although every
all-reduce hides under backward). :class:`Overheads` names four costs:

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
  once backward is over, nothing is left to slow.

Every cost is paid at any world size, one included: DDP on one rank still
hooks, buckets and launches (its all-reduce is a copy). With all four at
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
    source: str = "none: the bare alpha-beta replay"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"overheads: {f.name} must be a number >= 0, got {value!r}")

    def describe(self) -> str:
        return (f"{self.per_step_ms:g} ms per step, {self.per_gradient_us:g} us per gradient, "
                f"{self.per_bucket_us:g} us per bucket, compute slowed by {self.contention_us_per_MB:g} us "
                f"per MB a collective sends beside backward ({self.source})")


NO_OVERHEADS = Overheads()

OVERHEAD_PRESETS: dict[str, Overheads] = {
    "none": NO_OVERHEADS,
    # Fitted by `python benchmarks/published_ddp.py --fit` to resnet50 and resnext101_32x8d of PyTorch's DDP
    # benchmark (benchmarks/distributed/ddp/README.md in pytorch/pytorch: DGX-1, V100, NCCL, torch 1.4);
    # resnet101 and resnext50_32x4d held out. See docs/simulator_checked.md.
    "nccl-v100": Overheads(per_step_ms=0.0, per_gradient_us=27.0, per_bucket_us=15.0, contention_us_per_MB=30.0,
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
    do not overlap (one collective on the wire at a time).
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float, float]] = []

    @property
    def busy_until(self) -> float:
        """The end of the last interval (0 if none)."""
        return self.intervals[-1][1] if self.intervals else 0.0

    def slow(self, start: float, end: float, rate: float) -> None:
        if start < self.busy_until:
            raise ValueError(f"slowing intervals must not overlap: {start} starts before {self.busy_until}")
        if end > start and rate < 1.0:
            self.intervals.append((start, end, max(0.0, rate)))

    def wall(self, work_ms: float) -> float:
        """When backward has done ``work_ms`` of its own work (ms since it began)."""
        t, done = 0.0, 0.0
        for start, end, rate in self.intervals:
            if start - t >= work_ms - done:
                break
            done += start - t
            if rate > 0 and (end - start) * rate >= work_ms - done:
                return start + (work_ms - done) / rate
            done += (end - start) * rate
            t = end
        return t + (work_ms - done)

    def lost_ms(self, until_ms: float) -> float:
        """Wall time lost to slowing before ``until_ms``."""
        return sum((min(end, until_ms) - start) * (1 - rate)
                   for start, end, rate in self.intervals if start < until_ms)
