"""Lent bucket buffers: taken when a bucket needs one, given back as soon as its result is taken.

A gradients part that wraps another (:class:`LentBuckets`), installed with
:func:`lend_buckets` by what lends:

* ZeRO stage 2 (:mod:`minddp.zero.stage2`): buffers from its pool, and
  ``on_reduced(GradBucket)``: each bucket, once its communication is done,
  is offered to it (once per backward); True means "the result is taken
  care of" (stage 2 keeps its shard of the average) and no ``.grad`` is
  written from it. A bucket takes a buffer when its first gradient needs a
  slot and gives it back as soon as its result was taken: a few buffers in
  flight instead of a full copy of all gradients. Buffers come back dirty:
  every slot is overwritten before it is sent;
* ``lazy_bucket_allocation=True`` (:class:`BuffersPerBackward`): the same
  late ``acquire``, and every buffer released once its averages are in ``.grad``.
"""

from __future__ import annotations

from typing import Callable

from minddp.ddp.core.buckets import BucketStorage
from minddp.ddp.core.slots import GradientTransfer
from minddp.ddp.default_hooks import GradBucket

__all__ = ["BuffersPerBackward", "LentBuckets", "lend_buckets"]


class BuffersPerBackward(BucketStorage):
    """``lazy_bucket_allocation=True``: a bucket's buffer is allocated when its gradients are copied
    in and freed once the averages are back in ``.grad``, so none is held between steps."""

    keep_buffers = False
    release_after_backward = True


def lend_buckets(reducer, storage: BucketStorage, on_reduced: Callable[[GradBucket], bool] | None = None) -> None:
    """Take ``reducer``'s bucket buffers from ``storage`` and give them back early, from now on."""
    reducer.use_bucket_storage(storage)
    reducer.set_gradients(LentBuckets(reducer.gradients, storage, on_reduced))


class LentBuckets(GradientTransfer):
    """A gradients part around ``inner``: buffers acquired late and released as soon as they can be."""

    def __init__(self, inner: GradientTransfer, storage: BucketStorage, on_reduced: Callable[[GradBucket], bool] | None = None):
        self.inner, self.storage, self.on_reduced = inner, storage, on_reduced
        self._buckets: list = []
        self._offered: dict[int, bool] = {}  # this backward: bucket index -> did on_reduced take it?

    def room_after_gradients(self, bucket_index: int, bucket_count: int, dtype) -> int:
        return self.inner.room_after_gradients(bucket_index, bucket_count, dtype)

    def buckets_built(self, reducer) -> None:
        self._buckets, self._offered = reducer.buckets, {}
        self.inner.buckets_built(reducer)

    def gradient_ready(self, bucket, position: int, param) -> None:
        if bucket.buffer is None:  # (with bucket views, the first gradient takes the bucket's buffer)
            self._reclaim_finished()
        self.inner.gradient_ready(bucket, position, param)

    def fill_bucket(self, bucket, scale: float) -> None:
        if bucket.buffer is None:
            self._reclaim_finished()
            bucket.acquire()
        self.inner.fill_bucket(bucket, scale)

    def write_grads(self, bucket, used: list[bool] | None) -> None:
        if not self._hand_over(bucket):
            self.inner.write_grads(bucket, used)
            if self.storage.release_after_backward:  # lazy_bucket_allocation: nothing kept between steps
                bucket.release()
        if bucket is self._buckets[-1]:
            self._offered = {}  # the backward is over

    def _reclaim_finished(self) -> None:
        """Buffers go back as soon as their result is taken: before a bucket takes one, every launched
        bucket whose communication is done is offered (a buffer taken then can be lent again at once)."""
        if not self.storage.keep_buffers:
            for launched in self._buckets:
                if launched.index not in self._offered and launched.future is not None and launched.future.done():
                    self._hand_over(launched)

    def _hand_over(self, bucket) -> bool:
        """Offer a reduced bucket to ``on_reduced`` (once per backward); True if taken (then its buffer may
        go back; declined, ``.grad`` is written from it as usual)."""
        if bucket.index in self._offered:
            return self._offered[bucket.index]
        bucket.wait()
        taken = self.on_reduced is not None and bool(self.on_reduced(GradBucket(bucket, len(self._buckets))))
        self._offered[bucket.index] = taken
        if taken and not self.storage.keep_buffers:
            bucket.release()
        return taken
