"""What a bucket costs beyond its bytes on the wire, measured: the two costs ``plan_buckets`` charges.

The alpha-beta replay (:mod:`minddp_lab.simulate.replay`) prices a bucket by
its time on the wire. Two more costs grow with the number of buckets, and
both are measured here as the link is, on this machine, in this run:

* **MiniDDP's own work per bucket** (:func:`fixed_cost_us`): filling a
  bucket (one batched copy of its gradients, the scaling) and launching its
  collective run in Python on the thread that runs backward, so backward
  waits for them. The copy grows with the bytes, and every plan copies every
  byte once; what more buckets add is the part that does not grow: the calls
  themselves. :class:`BucketCostLog` times every fill and launch of the
  measured backwards in the CPU time of the thread that runs them (wall time
  would add every moment the thread waited for a core: on 2 shared cores a
  launch beside a running all-reduce took 0.1 to 6 ms of wall time; that
  wait is the contention below, not a cost per bucket); :func:`fixed_cost_us`
  keeps the fill's part at zero bytes (a straight line through the fills'
  times against their bytes) plus the launch.
* **The CPU a collective takes from backward** (:func:`contention_us_per_MB`):
  on a CPU rank with no core to spare for Gloo's thread, an all-reduce
  running beside backward takes the cores backward needs for the time it
  keeps them busy: nearly all of it over loopback (copies and sums), a few
  percent on a real link (the kernel moving bytes; the rest is waiting). The
  link probe times the CPU this process spent during its all-reduces; per MB
  sent, that is what the replay takes from backward while a bucket is on the
  wire (``Overheads.contention_us_per_MB``): a continuous charge, from
  "backward untouched" to "backward stands still", not a yes or no.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

from minddp.ddp.core.buckets import Bucket
from minddp.ddp.core.slots import Observer
from minddp_lab.network import bytes_sent_per_rank

__all__ = ["BucketCostLog", "fixed_cost_us", "contention_us_per_MB", "spare_core_per_rank"]


class BucketCostLog(Observer):
    """Which gradient came when in the last backward (``log``: ``(index, perf_counter)``), and the CPU
    seconds of each bucket's fill and launch.

    ``fills``: ``(bytes, seconds)`` from the hook of a bucket's last gradient to
    the bucket filled; ``launches``: seconds to launch each bucket's collective.
    Both in the CPU time of the thread that runs them (``time.thread_time``).
    """

    def __init__(self):
        self.log: list[tuple[int, float]] = []
        self.fills: list[tuple[int, float]] = []
        self.launches: list[float] = []
        self._arrived = self._launching = 0.0

    def backward_started(self) -> None:
        self.log, self.fills, self.launches = [], [], []  # only this backward counts (an earlier may have failed)

    def gradient_ready(self, index: int, param: nn.Parameter) -> None:
        self.log.append((index, time.perf_counter()))
        self._arrived = time.thread_time()

    def bucket_filled(self, bucket: Bucket, scale: float) -> None:
        self.fills.append((bucket.numel * bucket.dtype.itemsize, time.thread_time() - self._arrived))

    def bucket_launching(self, bucket: Bucket) -> None:
        self._launching = time.thread_time()

    def bucket_launched(self, bucket: Bucket) -> None:
        self.launches.append(time.thread_time() - self._launching)


def fixed_cost_us(fills: list[tuple[int, float]], launches: list[float]) -> float:
    """MiniDDP's work per bucket that does not grow with its bytes, in us: the fill at zero bytes, plus a launch.

    The fill at zero bytes: the median fill time of each bucket size, a
    least-squares line through those points, its value at zero, kept within
    [0, the fastest fill] (noise can tilt a line through two sizes either
    way). With one size only, the line cannot be drawn: the fastest fill
    counts whole, copy included (an upper bound). The launch: the median.
    """
    if not fills:
        return 0.0
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in fills:
        by_size.setdefault(nbytes, []).append(seconds)
    points = [(float(n), statistics.median(ts)) for n, ts in sorted(by_size.items())]
    fastest = min(seconds for _, seconds in fills)
    if len(points) == 1:
        at_zero = fastest
    else:
        line = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
        at_zero = min(max(line.intercept, 0.0), fastest)
    launch = statistics.median(launches) if launches else 0.0
    return (at_zero + launch) * 1e6


def contention_us_per_MB(device: torch.device, world_size: int, cpu_seconds: float, nbytes: float) -> float:
    """Backward's CPU time an all-reduce beside it takes, in us per MB this rank sends.

    ``cpu_seconds``: what this process spent during one all-reduce of
    ``nbytes`` (the link probe's). Zero where the all-reduce has other hands
    than backward's: a GPU (its streams), or a CPU with a core to spare per
    rank for Gloo's thread.
    """
    if device.type != "cpu" or spare_core_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))):
        return 0.0
    sent_mb = bytes_sent_per_rank("all_reduce", nbytes, world_size) / 1e6
    return cpu_seconds * 1e6 / sent_mb if sent_mb > 0 else 0.0


def spare_core_per_rank(ranks_here: int, threads_per_rank: int | None = None, cores: int | None = None) -> bool:
    """Does every one of ``ranks_here`` ranks on this machine have a core beyond its compute threads
    (``torch.get_num_threads()`` unless given), for Gloo's? ``cores``: this machine's, unless given."""
    threads = torch.get_num_threads() if threads_per_rank is None else threads_per_rank
    return (cores or os.cpu_count() or 1) >= ranks_here * (threads + 1)
