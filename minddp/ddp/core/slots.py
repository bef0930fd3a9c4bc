"""The reducer's slots: what it asks of each part it holds, and what it tells those who watch.

:class:`~minddp.ddp.core.reducer.Reducer` holds one *part* per slot and calls
it at named steps of the path of a gradient. Each slot is an abstract base
class: a part that leaves out one of its methods fails where it is
constructed, with the method's name (as FSDP2's ``_fsdp_api.py`` holds its
collectives to theirs), instead of silently doing nothing mid-backward.

* :class:`Readiness`: when is a parameter's gradient ready for its bucket?
* :class:`GradientTransfer`: how a gradient gets into its bucket slot, and the average back into ``.grad``;
* :class:`Communication`: how a complete bucket travels (an all-reduce, a comm hook).

The plain part of each is in ``reducer.py``; the others live outside the core
(:mod:`minddp.ddp.parts`). :class:`Observer` is not a slot but the events the
reducer names as it goes: what only watches (the timeline, a followed
gradient) and what acts between backwards (the learned bucket order,
:mod:`minddp.ddp.policies`) subclass it and override the events they need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import nn

# In the annotations below, ``Reducer`` is minddp.ddp.core.reducer.Reducer and ``Bucket``
# minddp.ddp.core.buckets.Bucket, named and not imported: the reducer imports this module.

__all__ = ["Readiness", "GradientTransfer", "Communication", "Observer", "Observers"]


class Readiness(ABC):
    """When is a parameter ready? (plain: at its hook; ``find_unused_parameters``, ``static_graph``)"""

    used_on_some_rank: list[bool] | None = None  # per parameter, after a backward; None: every one had a gradient

    @abstractmethod
    def prepare_for_backward(self, reducer: Reducer, output: Any) -> None:
        """After a synchronized forward, with its output."""

    @abstractmethod
    def is_ready(self, reducer: Reducer, index: int) -> bool:
        """At ``params[index]``'s hook: count it ready now? (It may mark others ready: ``reducer.mark_ready``.)"""

    @abstractmethod
    def backward_ending(self, reducer: Reducer) -> None:
        """Before the check that every bucket was launched."""

    @abstractmethod
    def shadow_backward(self, reducer: Reducer) -> None:
        """A joined rank's stand-in for a backward, after the buckets: the same collectives as the others'."""


class GradientTransfer(ABC):
    """How a gradient gets into its bucket slot and the average back into ``.grad``."""

    @abstractmethod
    def buckets_built(self, reducer: Reducer) -> None:
        """The buckets were (re)built (``reducer.buckets``)."""

    @abstractmethod
    def gradient_ready(self, bucket: Bucket, position: int, param: nn.Parameter) -> None:
        """``param`` (at ``position`` in ``bucket``) has its gradient (plain: nothing yet, the copy waits)."""

    @abstractmethod
    def fill_bucket(self, bucket: Bucket, scale: float) -> None:
        """Every gradient of a complete bucket into its slot, times ``scale`` (1/N)."""

    @abstractmethod
    def write_grads(self, bucket: Bucket, used: list[bool] | None) -> None:
        """The averages (the bucket has arrived) into ``.grad``; ``used``: ``Readiness.used_on_some_rank``."""

    def room_after_gradients(self, bucket_index: int, bucket_count: int, dtype: torch.dtype) -> int:
        """Elements to leave after bucket ``bucket_index``'s gradients, for what rides along (none)."""
        return 0


class Communication(ABC):
    """How a complete bucket travels."""

    divides_first: bool = True  # does the reducer scale gradients by 1/N before? (False: the hook averages)
    comm_hook: tuple[Any, Callable] | None = None  # (state, hook) of a registered comm hook; None: none

    @abstractmethod
    def communicate(self, bucket: Bucket) -> torch.futures.Future:
        """Start reducing ``bucket.buffer`` over the ranks; a future of the reduced buffer."""


class Observer:
    """The events of the path, in the order they come; each does nothing here: override the ones you need
    and ``reducer.add_observer(it)``. Not abstract on purpose: a watcher wants two or three events."""

    def forward_started(self) -> None: ...
    def forward_done(self) -> None: ...
    def backward_started(self) -> None: ...
    def gradient_ready(self, index: int, param: nn.Parameter) -> None: ...
    def bucket_filled(self, bucket: Bucket, scale: float) -> None: ...
    def bucket_launching(self, bucket: Bucket) -> None: ...
    def bucket_launched(self, bucket: Bucket) -> None: ...  # bucket.future: its communication
    def backward_ending(self) -> None: ...  # the end-of-backward wait begins
    def bucket_reduced(self, bucket: Bucket) -> None: ...  # its sum is in its buffer
    def grads_written(self, bucket: Bucket) -> None: ...
    def backward_done(self) -> None: ...
    def after_backward(self) -> None: ...  # the backward is over and its frames are gone: buckets may change now


class Observers(Observer):
    """Several observers as one: each event goes to each, in the order they were added.

    ``Observers.of(...)`` gives the plain :class:`Observer` when there are none, so that the plain path
    calls one empty method per event and loops over nothing.
    """

    def __init__(self, observers: tuple[Observer, ...]):
        self.observers = observers

    @staticmethod
    def of(observers: tuple[Observer, ...]) -> Observer:
        return Observers(observers) if observers else Observer()

    def __iter__(self):
        return iter(self.observers)

    def forward_started(self) -> None:
        for observer in self.observers:
            observer.forward_started()

    def forward_done(self) -> None:
        for observer in self.observers:
            observer.forward_done()

    def backward_started(self) -> None:
        for observer in self.observers:
            observer.backward_started()

    def gradient_ready(self, index: int, param: nn.Parameter) -> None:
        for observer in self.observers:
            observer.gradient_ready(index, param)

    def bucket_filled(self, bucket: Bucket, scale: float) -> None:
        for observer in self.observers:
            observer.bucket_filled(bucket, scale)

    def bucket_launching(self, bucket: Bucket) -> None:
        for observer in self.observers:
            observer.bucket_launching(bucket)

    def bucket_launched(self, bucket: Bucket) -> None:
        for observer in self.observers:
            observer.bucket_launched(bucket)

    def backward_ending(self) -> None:
        for observer in self.observers:
            observer.backward_ending()

    def bucket_reduced(self, bucket: Bucket) -> None:
        for observer in self.observers:
            observer.bucket_reduced(bucket)

    def grads_written(self, bucket: Bucket) -> None:
        for observer in self.observers:
            observer.grads_written(bucket)

    def backward_done(self) -> None:
        for observer in self.observers:
            observer.backward_done()

    def after_backward(self) -> None:
        for observer in self.observers:
            observer.after_backward()
