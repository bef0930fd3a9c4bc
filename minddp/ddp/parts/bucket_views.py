"""``gradient_as_bucket_view=True``: each ``.grad`` *is* its slot in the bucket.

No copy into the bucket before the all-reduce and none back after it, and no
second copy of all gradients in memory: autograd accumulates straight into
the bucket. A parameter's ``.grad`` becomes its slot when the buckets are
built (and rebuilt: a gradient kept across a rebuild moves into its new
slot), or, after ``zero_grad(set_to_none=True)`` made autograd allocate a
fresh ``.grad``, at its hook: copied into the slot at once, so its memory
goes back at once (as torch's reducer does). Only for a dense gradient in a
bucket of the parameter's own dtype (not with ``reduce_dtype``).

A gradients part, :class:`BucketViews`: it keeps each ``.grad`` in its
slot, and leaves filling the bucket and writing ``.grad`` to a
:class:`~minddp.ddp.parts.gradient_cases.GradientCases` it holds, told
which gradients are views (a view needs no copy either way; a sparse one or
one of another dtype is copied as usual). ZeRO stage 2 chooses it too (its
pool's buffers take each gradient at its hook).
"""

from __future__ import annotations

from minddp.ddp.core.buckets import Bucket
from minddp.ddp.core.slots import GradientTransfer
from minddp.ddp.parts.gradient_cases import GradientCases

__all__ = ["BucketViews"]


class BucketViews(GradientTransfer):
    """Gradients as views into the buckets (``never``: parameter indices whose gradients are sparse)."""

    def __init__(self, count: int, never: frozenset[int] = frozenset()):
        self.cases = GradientCases(count)  # fills the buckets and writes .grad, views included
        self.never = never

    def buckets_built(self, reducer) -> None:
        as_view, sparse = self.cases.as_view, self.cases.sparse_dim
        for bucket in reducer.buckets:
            for position, (index, p) in enumerate(zip(bucket.indices, bucket.params)):
                as_view[index] = bucket.dtype == p.dtype and index not in self.never and index not in sparse
                if p.grad is not None and as_view[index] and bucket.buffer is not None:
                    p.grad = bucket.views[position].copy_(p.grad)  # kept across a rebuild: into its new slot

    def gradient_ready(self, bucket: Bucket, position: int, param) -> None:
        index = bucket.indices[position]
        if self.cases.as_view[index] and (grad := param.grad) is not None and not grad.is_sparse:
            if bucket.buffer is None:  # a storage that lends buffers: the bucket's first use this backward
                bucket.acquire()
            if grad is not (slot := bucket.views[position]):
                # After zero_grad(set_to_none=True) autograd made a fresh .grad: into its slot now, so
                # its memory goes back at once, not when the whole bucket is complete (as torch's
                # reducer; batching these copies per bucket measured no faster, and held up to a
                # bucket of gradients twice).
                param.grad = slot.copy_(grad)

    def fill_bucket(self, bucket: Bucket, scale: float) -> None:
        self.cases.fill_bucket(bucket, scale)

    def write_grads(self, bucket: Bucket, used: list[bool] | None) -> None:
        self.cases.write_grads(bucket, used)
