"""The link probe of ``plan_buckets``: all-reduces through the buckets' own path, timed and fitted.

:class:`~minddp_lab.auto.planner.AutoBuckets` sends scratch buffers of
two sizes the way its reducer's buckets travel (:func:`communicate_buffer`:
its communication part, a comm hook included, so a simulated link is
measured as such), times each (:func:`timed`: the wall time, and the CPU
this process spent meanwhile) and fits alpha and the bandwidth
(:func:`fit_latency_bandwidth`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from minddp_lab.network import Link, fit_link

__all__ = ["ScratchBucket", "communicate_buffer", "fit_latency_bandwidth", "timed"]


@dataclass
class ScratchBucket:
    """A stand-in bucket with no parameters, for the link probe; its index is past the real buckets',
    so no comm hook mistakes it for one."""

    buffer: torch.Tensor
    index: int
    params: tuple = ()
    views: tuple = ()


def communicate_buffer(reducer, buffer: torch.Tensor) -> torch.futures.Future:
    """Send a scratch ``buffer`` the way ``reducer``'s buckets travel (its communication part: a comm hook
    included, so a simulated link is measured as such)."""
    return reducer.communication.communicate(ScratchBucket(buffer, len(reducer.buckets)))


def fit_latency_bandwidth(sizes: list[float], seconds: list[float], world_size: int) -> Link:
    """:func:`~minddp_lab.network.fit_link`, or a latency-only link where time does not grow with size.

    On a link whose latency dwarfs the probe's bytes (tens of ms per message,
    GB/s), the noise between two timings can exceed what the bytes add, and
    the fitted slope comes out <= 0: the bytes cost nothing measurable.
    """
    try:
        return fit_link(sizes, seconds, world_size, "measured")
    except ValueError:
        steps = 2 * (world_size - 1)
        return Link("measured", statistics.median(seconds) / steps, 1e18,
                    "latency only: all-reduce times did not grow with size")


def _wait_done(future: torch.futures.Future, buffer: torch.Tensor) -> None:
    """Wait until the all-reduce has really happened: an NCCL future's wait
    only makes the current stream wait, so the host waits for the device too."""
    future.wait()
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)


def timed(communicate: Callable[[torch.Tensor], torch.futures.Future], buffer: torch.Tensor) -> tuple[float, float]:
    """Wall seconds of one all-reduce, and CPU seconds this process spent meanwhile."""
    start, cpu = time.perf_counter(), time.process_time()
    _wait_done(communicate(buffer), buffer)
    return time.perf_counter() - start, time.process_time() - cpu
