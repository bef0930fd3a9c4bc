"""Watching the path: the step timeline, the Chrome-trace tracer, and torch.profiler's ranges.

Nothing here runs unless asked for:

* :class:`Observed` (``MiniDDP(..., timeline=True)`` or ``trace=True``)
  reports each event of a synchronized step to a
  :class:`~minddp.trace.StepObserver` (backward began, bucket complete,
  bucket launched, backward done): the timeline of the last backward, and
  with ``trace=True`` the tracer's events;
* :class:`ObservedGradients` (``trace=True``) adds one event per gradient
  hook and the forward's span;
* :class:`ProfilerRanges` is stacked for one backward when a
  ``torch.profiler`` is recording as it starts: a range per bucket launch
  and one around the end-of-backward wait.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from minddp.features import Layer

__all__ = ["Observed", "ObservedGradients", "ProfilerRanges"]


class Observed(Layer):
    height = 25

    def attach(self, observer) -> None:
        self.observer = observer

    def start_backward(self) -> None:
        super().start_backward()
        self.observer.backward_started()

    def bucket_ready(self, bucket) -> None:
        self.observer.bucket_complete()
        super().bucket_ready(bucket)

    def communicate(self, bucket) -> torch.futures.Future:
        launched = time.perf_counter()
        future = super().communicate(bucket)
        if bucket.index < len(self.buckets):  # not a scratch buffer (communicate_buffer)
            self.observer.bucket_launched(bucket.index, bucket.buffer.nbytes, launched, future)
        return future

    def finish_backward(self) -> None:
        super().finish_backward()
        self.observer.backward_done()


class ObservedGradients(Observed):
    height = 26

    def prepare_for_forward(self, sync: bool, buffers_due: bool) -> int | None:
        self._forward_started = self.observer.forward_started()
        return super().prepare_for_forward(sync, buffers_due)

    def prepare_for_backward(self, output: Any) -> None:
        self.observer.forward_done(self._forward_started)
        super().prepare_for_backward(output)

    def on_grad_ready(self, index: int, param) -> None:
        self.observer.gradient_ready(self.names[index], param.grad)
        super().on_grad_ready(index, param)


class ProfilerRanges(Layer):
    height = 50

    def communicate(self, bucket) -> torch.futures.Future:
        with torch.profiler.record_function(f"minddp.launch_bucket_{bucket.index}"):
            return super().communicate(bucket)

    def finish_backward(self) -> None:
        try:
            with torch.profiler.record_function("minddp.wait_buckets"):
                super().finish_backward()
        finally:
            self.remove_layer(ProfilerRanges)  # one backward; the next one looks again
