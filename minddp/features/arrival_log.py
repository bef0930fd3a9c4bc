"""The arrival log: which gradient came when in the last backward, kept only while someone watches.

``reducer.watch_arrivals(watcher)`` stacks this layer, ``watch_arrivals(watcher,
on=False)`` takes it off once the last watcher is done. Its readers are
policies above the reducer: the learned bucket order
(:mod:`minddp.bucket_order`, the first backward) and
``bucket_cap_mb="auto"`` (:mod:`minddp.bucket_planner`, its measured steps).
"""

from __future__ import annotations

import time

from minddp.features import Layer

__all__ = ["ArrivalLog"]


class ArrivalLog(Layer):
    height = 20

    def attach(self) -> None:
        self._arrival_watchers: set[object] = set()
        self.arrival_log: list[tuple[int, float]] = []  # this backward's (index, perf_counter)

    def start_backward(self) -> None:
        self.arrival_log = []  # only this backward's order counts (an earlier one may have failed)
        super().start_backward()

    def on_grad_ready(self, index: int, param) -> None:
        self.arrival_log.append((index, time.perf_counter()))
        super().on_grad_ready(index, param)
