"""Watch a learner's asynchronous all-reduces: when each was launched, in which step, and when it was waited for.

An async all-reduce on Gloo writes its sum into the tensor whenever it
finishes: code that reads the tensor before ``wait()`` is wrong, yet often
reads the right sum by luck. The watched ``dist.all_reduce`` takes that luck
away. It sums a private copy of the tensor and hands back a ``HeldWork``
that writes the sum into the learner's tensor only when ``wait()`` is called
(or the future from ``get_future()`` completes): reading early reads this
rank's own numbers, every time. Waiting for that future, alone or through
``torch.futures.wait_all``, counts as a wait. ``HeldWork`` also notes
whether the tensor was changed between the launch and the wait (a division
written before the wait), and lives only as long as the learner holds it
(``handles()`` lists those, for a step that never lets go of what it
launched).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Launch:
    at: float  # perf_counter
    step: int
    is_async: bool
    numel: int


class _Delivery:
    """Writes the finished sum into the learner's tensor, once; notes a tensor changed since its launch."""

    def __init__(self, tensor: torch.Tensor, private: torch.Tensor, watch: "Watch"):
        self.tensor, self.private, self.watch = tensor, private, watch
        self.launched = tensor.detach().clone()
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        if not torch.equal(self.tensor, self.launched):
            self.watch.changed_before_wait += 1
        self.tensor.copy_(self.private)


class HeldWork:
    """The learner's handle: the sum reaches their tensor at ``wait()`` (or completion seen), never earlier."""

    def __init__(self, work, delivery: _Delivery, step: int):
        self._work, self._delivery = work, delivery  # the delivery does not refer back: no cycle through C++
        self.step = step

    def wait(self, *args, **kwargs):
        self._delivery.watch.waits.append(time.perf_counter())
        result = self._work.wait(*args, **kwargs)
        self._delivery()
        return result

    def is_completed(self) -> bool:
        if self._work.is_completed():
            self._delivery()
            return True
        return False

    def get_future(self):
        delivery = self._delivery

        def delivered(future):
            future.value()
            delivery()
            return [delivery.tensor]
        return WatchedFuture(self._work.get_future().then(delivered), delivery.watch.waits)

    def __getattr__(self, name):
        return getattr(self._work, name)


class WatchedFuture:
    """The learner's future: notes when it is waited for, directly or through ``torch.futures.wait_all``."""

    def __init__(self, future, waits: list):
        self._future, self._waits = future, waits

    def wait(self):
        self._waits.append(time.perf_counter())
        return self._future.wait()

    def value(self):
        self._waits.append(time.perf_counter())
        return self._future.value()

    def then(self, callback):
        return WatchedFuture(self._future.then(callback), self._waits)

    def __getattr__(self, name):
        return getattr(self._future, name)


def _unwrapped(futures) -> list:
    """torch's own futures, for ``torch.futures.wait_all`` and ``collect_all``, which hand them to C++."""
    return [f._future if isinstance(f, WatchedFuture) else f for f in futures]


class Watch:
    """While active, every dist.all_reduce is recorded (a ``Launch``); async ones are held back until waited for."""

    def __init__(self):
        self.launches: list[Launch] = []
        self.waits: list[float] = []
        self.step = 0  # set by the bench at each step's start
        self.changed_before_wait = 0  # tensors written between their launch and their wait()
        self._handles = weakref.WeakSet()

    def per_step(self, steps: int) -> list[int]:
        """All-reduces launched in each step."""
        return [sum(launch.step == s for launch in self.launches) for s in range(steps)]

    def handles(self) -> list["HeldWork"]:
        """The handles the learner still holds (each knows the step it was launched in)."""
        return list(self._handles)

    @contextlib.contextmanager
    def active(self):
        original = dist.all_reduce

        def all_reduce(tensor, *args, async_op=False, **kwargs):
            self.launches.append(Launch(time.perf_counter(), self.step, async_op, tensor.numel()))
            if not async_op:
                return original(tensor, *args, **kwargs)
            private = tensor.detach().clone()
            delivery = _Delivery(tensor, private, self)
            handle = HeldWork(original(private, *args, async_op=True, **kwargs), delivery, self.step)
            self._handles.add(handle)
            return handle

        wait_all, collect_all = torch.futures.wait_all, torch.futures.collect_all

        def waited_all(futures):
            self.waits.append(time.perf_counter())
            return wait_all(_unwrapped(futures))

        def collected_all(futures):  # one future for them all: waiting for it waits for each
            return WatchedFuture(collect_all(_unwrapped(futures)), self.waits)

        dist.all_reduce = all_reduce
        torch.futures.wait_all, torch.futures.collect_all = waited_all, collected_all
        try:
            yield self
        finally:
            dist.all_reduce = original
            torch.futures.wait_all, torch.futures.collect_all = wait_all, collect_all
