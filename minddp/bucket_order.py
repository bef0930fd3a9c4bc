"""Buckets in the order gradients really arrive, learned from the first backward (torch's DDP does this).

The reducer first buckets parameters in reverse registration order: a guess
that the last layer registered is the first whose gradient is ready. A model
that registers its layers in another order than it runs them (a head defined
before the body, a module reused) breaks the guess, and a bucket then waits
for one late gradient while its others are long done, and launches late.

So after the first synchronized backward the buckets are rebuilt once, in
the order the gradients came. Every rank must build the same buckets (they
are what keeps collectives matched), so rank 0's order is broadcast and
everyone uses it. A policy on the reducer's interface, like
``bucket_cap_mb="auto"`` (:mod:`minddp.bucket_planner`): it adds an
:class:`ArrivalLog` to the reducer's observers, is called at the end of the
backward (``backward_done_callbacks``), and calls ``rebuild``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minddp.reducer import Observer

__all__ = ["ArrivalLog", "LearnedBucketOrder"]


class ArrivalLog(Observer):
    """An observer: which gradient came when in the last backward (``log``: ``(index, perf_counter)``)."""

    def __init__(self):
        self.log: list[tuple[int, float]] = []

    def backward_started(self) -> None:
        self.log = []  # only this backward's order counts (an earlier one may have failed)

    def gradient_ready(self, index: int, param) -> None:
        self.log.append((index, time.perf_counter()))


class LearnedBucketOrder:
    """Rebuild ``reducer``'s buckets once, after its first backward, in rank 0's arrival order."""

    def __init__(self, reducer):
        self.reducer, self.arrivals = reducer, ArrivalLog()
        reducer.add_observer(self.arrivals)
        reducer.backward_done_callbacks.append(self.after_first_backward)

    def after_first_backward(self) -> None:
        reducer = self.reducer
        reducer.remove_observer(self.arrivals)
        reducer.backward_done_callbacks.remove(self.after_first_backward)
        arrived = list(dict.fromkeys(i for i, _ in self.arrivals.log))
        seen = set(arrived)  # parameters that got no gradient keep the guess: reverse registration
        order = arrived + [i for i in reversed(range(len(reducer.params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=reducer.device)
        rank0 = dist.get_process_group_ranks(reducer.process_group)[0]  # a global rank, as broadcast wants
        dist.broadcast(order_t, src=rank0, group=reducer.process_group)
        order = order_t.tolist()
        if order != reducer.bucket_order:
            reducer.rebuild(order, *reducer.caps)
