"""The reducer's hook points: what the policies above the gradient path may call.

Mechanism below, policy above. :class:`~minddp.reducer.Reducer` moves
gradients; what *decides* (the learned bucket order, ``bucket_cap_mb="auto"``,
ZeRO stage 2's partition and pool, the buffers riding with the gradients)
lives above it and drives it through these few points, and nothing else:

* ``watch_arrivals(watcher)`` and ``arrival_log``: which gradient came when
  in the last backward, kept only while someone watches;
* ``backward_done_callbacks``: called at the end of every synchronized
  backward (and of a joined rank's stand-in for one), after ``.grad`` is
  written;
* ``rebuild(order, cap_bytes, first_cap_bytes)``, ``bucket_order``, ``caps``:
  bucket the parameters anew, between steps, the same on every rank;
* ``communicate_buffer(buffer)``: a scratch buffer sent the way buckets
  travel (comm hook included), to time the link;
* ``bucket_reduced_hook`` and ``use_bucket_storage(storage)``: take a
  reduced bucket's result elsewhere, and lend bucket buffers from a pool;
* ``carry_in_last_bucket(passenger)``: extra elements in the last bucket's
  communication.

A base class of the reducer, so the file a learner reads first,
``reducer.py``, holds only the path of a gradient. It expects of the
subclass ``params``, ``buckets``, ``_indices``, ``backward_started``,
``_build_buckets(order)`` and ``_communicate(bucket)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from minddp.buckets import BucketStorage, ScratchBucket
from minddp.comm_hooks import GradBucket

__all__ = ["ReducerHookPoints"]


class ReducerHookPoints:
    """The reducer's narrow interface for the policies above it (see the module docstring)."""

    def _init_hook_points(self, cap_bytes: int, first_cap_bytes: int | None, per_bucket_caps: list[int]) -> None:
        self._caps = (cap_bytes, first_cap_bytes)
        self._per_bucket_caps = per_bucket_caps  # bucket_cap_mb_list, in bytes; [] when not given
        self._storage = BucketStorage()  # where bucket buffers come from (use_bucket_storage)
        # A passenger in the last bucket (carry_in_last_bucket): MiniDDP's buffers, with buffer_sync="with_gradients".
        self.passenger = None
        self.carry_passenger = False  # set at each synchronized forward: does this backward carry it?
        self.passenger_arrived = False  # did the last backward bring it? (MiniDDP delivers it at forward)
        self.arrival_log: list[tuple[int, float]] = []  # this backward's (index, perf_counter), while watched
        self._arrival_watchers: set[object] = set()
        self._recording = False  # anyone watching? Read by every hook: one attribute
        self.backward_done_callbacks: list[Callable[[], None]] = []
        # Why the buckets will still change, if a policy above plans to rebuild them.
        self.planned_rebuild: str | None = None
        # ZeRO stage 2's hook point: called with each bucket once its communication
        # is done; True means "the result is taken care of": no .grad is written.
        self._bucket_reduced_hook: Callable[[GradBucket], bool] | None = None

    @property
    def bucket_reduced_hook(self) -> Callable[[GradBucket], bool] | None:
        return self._bucket_reduced_hook

    @bucket_reduced_hook.setter
    def bucket_reduced_hook(self, hook: Callable[[GradBucket], bool] | None) -> None:
        if hook is not None and self.planned_rebuild is not None:
            raise ValueError(
                f"{self.planned_rebuild}, and ZeRO stage 2 (shard_gradients=True) partitions gradients by "
                "those buckets: give MiniDDP a fixed bucket_cap_mb to use them together")
        self._bucket_reduced_hook = hook

    def watch_arrivals(self, watcher: object, on: bool = True) -> None:
        """Keep ``arrival_log`` (which gradient came when) for every backward while some ``watcher`` asks."""
        (self._arrival_watchers.add if on else self._arrival_watchers.discard)(watcher)
        self._recording = bool(self._arrival_watchers)

    @property
    def caps(self) -> tuple[int, int | None]:
        """Bucket cap and first-bucket cap, in bytes."""
        return self._caps

    @property
    def bucket_order(self) -> list[int]:
        """Parameter indices in the order the buckets hold them."""
        return [i for indices in self._indices for i in indices]

    def rebuild(self, order: list[int], cap_bytes: int, first_cap_bytes: int | None) -> None:
        """Bucket the parameters anew: indices in expected-arrival ``order``, these caps.

        Between backwards only, and with the same arguments on every rank
        (the caller broadcasts its decision): buckets are what keeps the
        ranks' collectives matched.
        """
        if self.backward_started:
            raise RuntimeError("Reducer.rebuild during a backward: buckets change only between steps")
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"Reducer.rebuild needs every parameter index once, got {order}")
        self._caps = (cap_bytes, first_cap_bytes)
        self._build_buckets(order)

    def carry_in_last_bucket(self, passenger) -> None:
        """Send ``passenger`` (``numel``, ``fits(dtype)``, ``pack(tail)``, ``receive(tail)``) in the last
        bucket's communication, in ``numel`` extra elements after its gradients; None stops it."""
        self.passenger = passenger
        self._build_buckets(self.bucket_order)

    def use_bucket_storage(self, storage: BucketStorage) -> None:
        """Take bucket buffers from ``storage`` from now on (see :class:`~minddp.buckets.BucketStorage`):
        with ``keep_buffers`` False, a buffer goes back as soon as the ``bucket_reduced_hook`` took its result."""
        for bucket in self.buckets:
            bucket.release()
        self._storage = storage
        self._build_buckets(self.bucket_order)

    def communicate_buffer(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Send a scratch ``buffer`` the way buckets travel (comm hook included), e.g. to time the link."""
        return self._communicate(ScratchBucket(buffer, len(self.buckets)))
