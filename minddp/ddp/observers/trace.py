"""Seeing overlap: when gradients arrived and when their buckets travelled.

When asked for (``MiniDDP(..., timeline=True)`` or ``trace=True``), one
:class:`StepObserver` is in the reducer's observers and is told each event
of a step (backward began, gradient ready, bucket launched, backward done),
which it keeps; otherwise none of this runs. Two levels:

* :class:`StepTimeline` (``timeline=True``). It keeps four kinds of timestamps of
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

Whose time? On CPU (Gloo) the CPU does the work, and ``time.perf_counter``
(CLOCK_MONOTONIC on Linux, shared by the processes of one machine, so ranks
line up on one axis) says when. On a GPU the CPU only *queues* work: a hook
fires when the gradient's kernels are queued, and an NCCL all-reduce's
future completes when the collective is queued, so CPU times would draw
every all-reduce as a zero-length bar, hidden. There the tracer uses
:class:`DeviceClock`: a CUDA event recorded on the current stream at each
hook, at each launch, and in the all-reduce's completion callback (which
torch runs on a stream that waits for the collective), so the bars show when
the GPU did the work. The :class:`StepTimeline` stays on the CPU
clock: one event per hook would cost too much to keep on every step. Across
machines (and, for device times, across ranks) clocks do not line up:
compare tracks within a rank there.
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

from minddp.ddp.core.slots import Observer
from minddp.ddp.placement import on_device

__all__ = ["StepObserver", "StepTimeline", "Tracer", "HostClock", "DeviceClock", "ProfilerRanges", "profiler_range"]

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


class HostClock:
    """When the CPU got there: the right clock where the CPU does the work (Gloo on CPU tensors)."""

    def now(self) -> float:
        return time.perf_counter()

    def seconds(self, stamp: float) -> float:
        return stamp


class DeviceClock:
    """When the GPU got there: a CUDA event recorded on the device's current stream.

    An event's time is only known once the GPU has passed it, so stamps are
    read (:meth:`seconds`) at export, as seconds on the ``perf_counter`` axis:
    the origin is an event recorded right after a ``synchronize``, when the
    two clocks agree.
    """

    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.synchronize(device)
        self._origin_s = time.perf_counter()
        self._origin = self.now()

    def now(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, stamp: torch.cuda.Event) -> float:
        stamp.synchronize()
        return self._origin_s + self._origin.elapsed_time(stamp) / 1e3


def clock_for(device: torch.device | None) -> HostClock | DeviceClock:
    return DeviceClock(device) if device is not None and device.type == "cuda" else HostClock()


class Tracer:
    """Records hook and bucket events of every step, exports a Chrome trace.

    Times are stamps of ``clock`` (:class:`HostClock`, or :class:`DeviceClock`
    for a module on a GPU), turned into microseconds when read.
    """

    def __init__(self, rank: int, device: torch.device | None = None):
        self.rank = rank
        self.step = 0
        self.clock = clock_for(device)
        self._raw: list[dict[str, Any]] = []  # events whose "ts" (and "end") are still stamps
        # Completion callbacks run on the communication thread, possibly a
        # moment after backward's wait returned: count them, so an export can
        # wait until the last one has written its event.
        self._changed = threading.Condition()
        self._pending = 0

    def _add(self, event: dict[str, Any], step: int | None = None) -> None:
        step = self.step if step is None else step
        event.update(pid=self.rank, args={**event.get("args", {}), "step": step})
        with self._changed:
            self._raw.append(event)

    @property
    def events(self) -> list[dict[str, Any]]:
        """The events so far, in Chrome's form (``ts`` and ``dur`` in microseconds)."""
        with self._changed:
            raw = list(self._raw)
        return [self._resolved(e) for e in raw]

    def _resolved(self, event: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in event.items() if k != "end"}
        out["ts"] = _us(self.clock.seconds(event["ts"]))
        if "end" in event:
            out["dur"] = _us(self.clock.seconds(event["end"])) - out["ts"]
        return out

    def _wait_for_pending(self) -> None:
        if not self._changed.wait_for(lambda: self._pending == 0, timeout=30.0):
            raise RuntimeError(f"{self._pending} all-reduce(s) never completed; was the last backward finished?")

    def clear(self) -> None:
        """Forget the events so far (e.g. warm-up steps), once their callbacks have landed."""
        with self._changed:
            self._wait_for_pending()
            self._raw.clear()

    def forward_done(self, started: Any, ended: Any) -> None:
        """The wrapped module's forward (of a step that will synchronize); stamps of :attr:`clock`."""
        self._add({"name": "forward", "ph": "X", "ts": started, "end": ended, "tid": BACKWARD_TRACK})

    def gradient_ready(self, name: str, when: Any, grad: torch.Tensor | None = None) -> None:
        args = {} if grad is None else {"bytes": grad.numel() * grad.element_size(), "dtype": str(grad.dtype)}
        self._add({"name": f"grad {name}", "ph": "i", "s": "t", "ts": when, "tid": BACKWARD_TRACK, "args": args})

    def bucket_launched(self, index: int, nbytes: int, when: Any, future: torch.futures.Future) -> None:
        step = self.step  # the step it was launched in, not the one running when it ends

        def done(_: torch.futures.Future) -> None:
            # On a GPU torch runs this callback with a current stream that
            # waits for the collective: the event marks its end on the device.
            end = self.clock.now()
            self._add({"name": f"all_reduce bucket {index}", "ph": "X", "ts": when, "end": end,
                       "tid": COMM_TRACK, "args": {"bytes": nbytes}}, step)
            with self._changed:
                self._pending -= 1
                self._changed.notify_all()

        with self._changed:
            self._pending += 1
        future.add_done_callback(done)

    def backward_done(self, timeline: StepTimeline, started: Any = None, ended: Any = None) -> None:
        """End of a step's backward: ``started``/``ended`` stamps, or else ``timeline``'s CPU times."""
        if started is None or ended is None:
            started, ended = timeline.first_hook, timeline.finished
        if started is not None and ended is not None:
            self._add({"name": "backward (first hook .. grads written)", "ph": "X", "ts": started, "end": ended,
                       "tid": BACKWARD_TRACK})
        self.step += 1

    def chrome_trace(self, group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
        """Every rank's events in one trace dict on group rank 0 (None elsewhere).

        A collective: every rank of the group must call it.
        """
        everyone: list[Any] = [None] * dist.get_world_size(group)
        with self._changed:
            self._wait_for_pending()
        mine = self.events
        with on_device(self.clock.device) if isinstance(self.clock, DeviceClock) else contextlib.nullcontext():
            dist.all_gather_object(everyone, mine, group=group)
        if dist.get_rank(group) != 0:
            return None
        events = [e for rank_events in everyone for e in rank_events]
        for rank in range(len(everyone)):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            for tid, label in ((BACKWARD_TRACK, "backward"), (COMM_TRACK, "communication")):
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
        clock = "cuda events" if isinstance(self.clock, DeviceClock) else "perf_counter"
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"clock": clock}}

    def export_chrome_trace(self, path: str, group: dist.ProcessGroup | None = None) -> None:
        """Write :meth:`chrome_trace` to ``path`` on rank 0 (a collective)."""
        trace = self.chrome_trace(group)
        if trace is not None:
            with open(path, "w") as f:
                json.dump(trace, f)


class StepObserver(Observer):
    """Everything MiniDDP records about its steps: an observer of the reducer (``timeline=True``, ``trace=True``).

    The gradient path stays free of instrumentation: it tells its observers
    what happened, and this one keeps the :class:`StepTimeline` (one CPU
    clock read per event) and, only when tracing, the :class:`Tracer`
    (stamps of its own clock: CUDA events for a module on a GPU).
    """

    def __init__(self, rank: int, trace: bool, device: torch.device | None = None, names: list[str] = ()):
        self.timeline = StepTimeline()
        self.tracer = Tracer(rank, device) if trace else None
        self.names = names  # the reducer's parameter names, for the trace's gradient events
        self._backward_stamp: Any = None
        self._forward_stamp: Any = None
        self._launched = 0.0

    def forward_started(self) -> None:
        self._forward_stamp = self.tracer.clock.now() if self.tracer is not None else None

    def forward_done(self) -> None:
        if self.tracer is not None and self._forward_stamp is not None:
            self.tracer.forward_done(self._forward_stamp, self.tracer.clock.now())

    def backward_started(self) -> None:
        self.timeline.clear()
        self.timeline.first_hook = time.perf_counter()
        if self.tracer is not None:
            self._backward_stamp = self.tracer.clock.now()

    def gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """A gradient's hook (recorded only when tracing: the timeline needs no per-gradient record)."""
        if self.tracer is not None:
            self.tracer.gradient_ready(self.names[index], self.tracer.clock.now(), param.grad)

    def bucket_filled(self, bucket: Any, scale: float) -> None:
        """A bucket's last gradient is in. The last hook of a backward completes
        a bucket, so the last of these is the timeline's last hook."""
        self.timeline.last_hook = time.perf_counter()

    def bucket_launching(self, bucket: Any) -> None:
        self._launched = time.perf_counter()

    def bucket_launched(self, bucket: Any) -> None:
        """CPU time, for the timeline; the tracer stamps its own clock (the all-reduce is queued)."""
        launched = self._launched
        self.timeline.launches.append(launched)
        if self.tracer is not None:
            clock = self.tracer.clock
            self.tracer.bucket_launched(bucket.index, bucket.buffer.nbytes,
                                        launched if isinstance(clock, HostClock) else clock.now(), bucket.future)

    def backward_done(self) -> None:
        self.timeline.finished = time.perf_counter()
        if self.tracer is not None:
            self.tracer.backward_done(self.timeline, self._backward_stamp, self.tracer.clock.now())


class ProfilerRanges(Observer):
    """While a ``torch.profiler`` records: a range per bucket launch, and one around the end-of-backward wait.

    ``MiniDDP``'s forward adds it when it sees a profiler recording; it takes itself off after that
    backward (``record_function`` costs tens of microseconds even with no profiler listening)."""

    def __init__(self, reducer: Any):
        self.reducer = reducer
        self._range: Any = None

    def _enter(self, name: str) -> None:
        self._range = torch.profiler.record_function(name)
        self._range.__enter__()

    def _exit(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def bucket_launching(self, bucket: Any) -> None:
        self._enter(f"minddp.launch_bucket_{bucket.index}")

    def bucket_launched(self, bucket: Any) -> None:
        self._exit()

    def backward_ending(self) -> None:
        self._enter("minddp.wait_buckets")

    def backward_done(self) -> None:
        self._exit()
        self.reducer.remove_observer(self)  # one backward; the next forward looks again
