"""ZeRO stage 2's hook points: a reduced bucket's result taken elsewhere, bucket buffers lent from a pool.

* ``reducer.bucket_reduced_hook = hook``: each bucket, once its
  communication is done, is offered to ``hook(GradBucket)`` (once per
  backward); True means "the result is taken care of" (stage 2 keeps its
  shard of the average) and no ``.grad`` is written from it.
* ``reducer.use_bucket_storage(storage)`` with ``storage.keep_buffers``
  False: a bucket takes a buffer from the storage when its first gradient
  needs a slot, and gives it back as soon as its result was taken: a few
  buffers in flight instead of a full copy of all gradients. Buffers come
  back dirty: every slot is overwritten before it is sent.
* ``lazy_bucket_allocation=True`` (:class:`~minddp.buckets.BuffersPerBackward`): the same
  late ``acquire``, and every buffer released once its averages are in ``.grad``.
"""

from __future__ import annotations

from minddp.comm_hooks import GradBucket
from minddp.features import Layer

__all__ = ["LentBuckets"]


class LentBuckets(Layer):
    height = 10

    def attach(self) -> None:
        self._offered: set[int] = set()  # buckets waited for and offered to the hook, this backward
        self._reclaimed: set[int] = set()  # ... of which the hook took the result (no .grad to write)

    def start_backward(self) -> None:
        self._offered, self._reclaimed = set(), set()
        super().start_backward()

    def fill_bucket(self, bucket) -> None:
        bucket.acquire()  # a lending storage: the bucket's first use this backward
        super().fill_bucket(bucket)

    def bucket_ready(self, bucket) -> None:
        super().bucket_ready(bucket)
        if not self.storage.keep_buffers:  # buffers go back as soon as their result is taken
            for launched in self.buckets[: self._next_to_launch]:
                if launched.index not in self._offered and launched.future is not None and launched.future.done():
                    self._hand_over(launched)

    def write_grads(self, bucket) -> None:
        if not self._hand_over(bucket):
            super().write_grads(bucket)
            if self.storage.release_after_backward:  # lazy_bucket_allocation: nothing kept between steps
                bucket.release()

    def _hand_over(self, bucket) -> bool:
        """Offer a reduced bucket to the hook (once per backward); True if taken (then its buffer may go
        back; declined, ``.grad`` is written from it as usual)."""
        if bucket.index in self._offered:
            return bucket.index in self._reclaimed
        self._offered.add(bucket.index)
        bucket.wait()
        hook = self.bucket_reduced_hook
        if hook is None or not hook(GradBucket(bucket, len(self.buckets))):
            return False
        self._reclaimed.add(bucket.index)
        if not self.storage.keep_buffers:
            bucket.release()
        return True
