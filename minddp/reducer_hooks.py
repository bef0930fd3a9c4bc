"""The reducer's hook points: what the policies above the gradient path may call.

Mechanism below, policy above. :class:`~minddp.reducer.Reducer` moves
gradients; what *decides* (the learned bucket order, ``bucket_cap_mb="auto"``,
ZeRO stage 2's partition and pool) lives above it and drives it through
these few methods, and ``backward_done_callbacks`` (called at the end of
every synchronized backward, after ``.grad`` is written):

* ``watch_arrivals(watcher)``: keep ``arrival_log``, which gradient came
  when (:mod:`minddp.features.arrival_log`);
* ``rebuild(order, cap_bytes, first_cap_bytes)``, ``bucket_order``, ``caps``:
  bucket the parameters anew, between steps, the same on every rank;
* ``communicate_buffer(buffer)``: a scratch buffer sent the way buckets
  travel (comm hook included), to time the link;
* ``bucket_reduced_hook`` and ``use_bucket_storage(storage)``: take a
  reduced bucket's result elsewhere, and lend bucket buffers from a pool
  (:mod:`minddp.features.lent_buckets`).

A base class of the reducer, methods only: the state they change is the
reducer's own, set up in ``Reducer.__init__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from minddp.buckets import BucketStorage
from minddp.features.arrival_log import ArrivalLog
from minddp.features.lent_buckets import LentBuckets

__all__ = ["ReducerHookPoints", "ScratchBucket"]


@dataclass
class ScratchBucket:
    """A stand-in :class:`Bucket` with no parameters: a scratch buffer sent the way buckets travel
    (``Reducer.communicate_buffer``). Its index is past the real buckets', so no comm hook mistakes it for one."""

    buffer: torch.Tensor
    index: int
    params: tuple = ()
    views: tuple = ()


class ReducerHookPoints:
    """The reducer's narrow interface for the policies above it (see the module docstring)."""

    def watch_arrivals(self, watcher: object, on: bool = True) -> None:
        """Keep ``arrival_log`` (which gradient came when) while some ``watcher`` asks
        (the learned bucket order, ``bucket_cap_mb="auto"``)."""
        if on:
            self.add_layer(ArrivalLog)
            self._arrival_watchers.add(watcher)
        elif ArrivalLog in self._layers:
            self._arrival_watchers.discard(watcher)
            if not self._arrival_watchers:
                self.remove_layer(ArrivalLog)

    @property
    def bucket_order(self) -> list[int]:
        """Parameter indices in the order the buckets hold them."""
        return [i for indices in self._indices for i in indices]

    def rebuild(self, order: list[int], cap_bytes: int, first_cap_bytes: int | None) -> None:
        """Bucket the parameters anew: indices in expected-arrival ``order``, these caps.

        Between backwards only, and with the same arguments on every rank (the
        caller broadcasts its decision): buckets keep the ranks' collectives matched.
        """
        if self.backward_started:
            raise RuntimeError("Reducer.rebuild during a backward: buckets change only between steps")
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"Reducer.rebuild needs every parameter index once, got {order}")
        self.caps = (cap_bytes, first_cap_bytes)
        self._build_buckets(order)

    def communicate_buffer(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Send a scratch ``buffer`` the way buckets travel (comm hook included), e.g. to time the link."""
        return self.communicate(ScratchBucket(buffer, len(self.buckets)))

    def use_bucket_storage(self, storage: BucketStorage) -> None:
        """Take bucket buffers from ``storage`` from now on; with ``keep_buffers`` False, a buffer goes
        back as soon as the ``bucket_reduced_hook`` took its result (ZeRO stage 2)."""
        for bucket in self.buckets:
            bucket.release()
        self.storage = storage
        if not storage.keep_buffers:
            self.add_layer(LentBuckets)
        self._build_buckets(self.layout_order)

    @property
    def bucket_reduced_hook(self) -> Callable | None:
        """Called with each reduced bucket (a ``GradBucket``); True: its result is taken care of, no
        ``.grad`` is written (ZeRO stage 2's hook point, :mod:`minddp.features.lent_buckets`)."""
        return getattr(self, "_bucket_reduced_hook", None)

    @bucket_reduced_hook.setter
    def bucket_reduced_hook(self, hook: Callable | None) -> None:
        if hook is not None and self.planned_rebuild is not None:
            raise ValueError(
                f"{self.planned_rebuild}, and ZeRO stage 2 (shard_gradients=True) partitions gradients by "
                "those buckets: give MiniDDP a fixed bucket_cap_mb to use them together")
        self.add_layer(LentBuckets)
        self._bucket_reduced_hook = hook
