"""Seeing overlap: when gradients arrived and when their buckets travelled.

MiniDDP's gradient path reports to one :class:`StepObserver`, a call per
event (backward began, gradient ready, bucket launched, backward done); the
observer keeps the records. Two levels:

* :class:`StepTimeline` is always on. It keeps four kinds of timestamps of
  the last synchronized backward (first hook, last hook, each launch, end),
  one clock read per hook, which is how the tests prove that communication
  starts before backward ends.
* :class:`Tracer` is opt-in (``MiniDDP(..., trace=True)``). It records every
  gradient hook and every bucket's all-reduce from launch to completion, for
  every step, and writes a Chrome trace (open it in https://ui.perfetto.dev or
  chrome://tracing): one process per rank, one track for backward and one for
  communication. Where the communication bars sit under the backward bars,
  the all-reduce is hidden; where they stick out past the end of backward,
  that time is paid on top of compute.

Timestamps come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux), which
is shared by the processes of one machine, so ranks line up on one time axis.
Across machines they would not: compare tracks within a rank there.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StepObserver", "StepTimeline", "Tracer", "profiler_range"]

BACKWARD_TRACK, COMM_TRACK = 0, 1


@dataclass
class StepTimeline:
    """When things happened in the last synchronized backward (``perf_counter`` seconds)."""

    first_hook: float | None = None
    last_hook: float | None = None
    launches: list[float] = field(default_factory=list)  # one per bucket, in launch order
    finished: float | None = None

    def clear(self) -> None:
        self.first_hook = self.last_hook = self.finished = None
        self.launches = []


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range while a profiler runs; free otherwise.

    ``record_function`` costs tens of microseconds even with no profiler
    listening, a cost paid per bucket per step for nothing.
    """
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _us(seconds: float) -> float:
    return seconds * 1e6


class Tracer:
    """Records hook and bucket events of every step, exports a Chrome trace."""

    def __init__(self, rank: int):
        self.rank = rank
        self.step = 0
        self.events: list[dict[str, Any]] = []
        # Completion callbacks run on the communication thread, possibly a
        # moment after backward's wait returned: count them, so an export can
        # wait until the last one has written its event.
        self._changed = threading.Condition()
        self._pending = 0

    def _add(self, event: dict[str, Any], step: int | None = None) -> None:
        step = self.step if step is None else step
        event.update(pid=self.rank, args={**event.get("args", {}), "step": step})
        with self._changed:
            self.events.append(event)

    def _wait_for_pending(self) -> None:
        if not self._changed.wait_for(lambda: self._pending == 0, timeout=30.0):
            raise RuntimeError(f"{self._pending} all-reduce(s) never completed; was the last backward finished?")

    def clear(self) -> None:
        """Forget the events so far (e.g. warm-up steps), once their callbacks have landed."""
        with self._changed:
            self._wait_for_pending()
            self.events.clear()

    def forward_done(self, started: float, ended: float) -> None:
        """The wrapped module's forward (of a step that will synchronize)."""
        self._add({"name": "forward", "ph": "X", "ts": _us(started), "dur": _us(ended - started),
                   "tid": BACKWARD_TRACK})

    def gradient_ready(self, name: str, when: float, grad: torch.Tensor | None = None) -> None:
        args = {} if grad is None else {"bytes": grad.numel() * grad.element_size(), "dtype": str(grad.dtype)}
        self._add({"name": f"grad {name}", "ph": "i", "s": "t", "ts": _us(when), "tid": BACKWARD_TRACK,
                   "args": args})

    def bucket_launched(self, index: int, nbytes: int, when: float, future: torch.futures.Future) -> None:
        step = self.step  # the step it was launched in, not the one running when it ends

        def done(_: torch.futures.Future) -> None:
            end = time.perf_counter()
            self._add({"name": f"all_reduce bucket {index}", "ph": "X", "ts": _us(when), "dur": _us(end - when),
                       "tid": COMM_TRACK, "args": {"bytes": nbytes}}, step)
            with self._changed:
                self._pending -= 1
                self._changed.notify_all()

        with self._changed:
            self._pending += 1
        future.add_done_callback(done)

    def backward_done(self, timeline: StepTimeline) -> None:
        if timeline.first_hook is not None and timeline.finished is not None:
            self._add({"name": "backward (first hook .. grads written)", "ph": "X", "ts": _us(timeline.first_hook),
                       "dur": _us(timeline.finished - timeline.first_hook), "tid": BACKWARD_TRACK})
        self.step += 1

    def chrome_trace(self, group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
        """Every rank's events in one trace dict on group rank 0 (None elsewhere).

        A collective: every rank of the group must call it.
        """
        everyone: list[Any] = [None] * dist.get_world_size(group)
        with self._changed:
            self._wait_for_pending()
            mine = list(self.events)
        dist.all_gather_object(everyone, mine, group=group)
        if dist.get_rank(group) != 0:
            return None
        events = [e for rank_events in everyone for e in rank_events]
        for rank in range(len(everyone)):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            for tid, label in ((BACKWARD_TRACK, "backward"), (COMM_TRACK, "communication")):
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str, group: dist.ProcessGroup | None = None) -> None:
        """Write :meth:`chrome_trace` to ``path`` on rank 0 (a collective)."""
        trace = self.chrome_trace(group)
        if trace is not None:
            with open(path, "w") as f:
                json.dump(trace, f)


class StepObserver:
    """Everything MiniDDP records about its steps, behind one call per event.

    The gradient path stays free of instrumentation: it tells the observer
    what happened, and the observer keeps the always-on :class:`StepTimeline`
    (one clock read per event) and, only when tracing, the :class:`Tracer`.
    """

    def __init__(self, rank: int, trace: bool):
        self.timeline = StepTimeline()
        self.tracer = Tracer(rank) if trace else None

    def forward_started(self) -> float | None:
        return time.perf_counter() if self.tracer is not None else None

    def forward_done(self, started: float | None) -> None:
        if self.tracer is not None and started is not None:
            self.tracer.forward_done(started, time.perf_counter())

    def backward_started(self) -> None:
        self.timeline.clear()
        self.timeline.first_hook = time.perf_counter()

    def gradient_ready(self, name: str, grad: torch.Tensor | None) -> None:
        now = self.timeline.last_hook = time.perf_counter()
        if self.tracer is not None:
            self.tracer.gradient_ready(name, now, grad)

    def bucket_launched(self, index: int, nbytes: int, launched: float, future: torch.futures.Future) -> None:
        self.timeline.launches.append(launched)
        if self.tracer is not None:
            self.tracer.bucket_launched(index, nbytes, launched, future)

    def backward_done(self) -> None:
        self.timeline.finished = time.perf_counter()
        if self.tracer is not None:
            self.tracer.backward_done(self.timeline)
