"""``gradient_as_bucket_view=True``: each ``.grad`` *is* its slot in the bucket.

No copy into the bucket before the all-reduce and none back after it, and no
second copy of all gradients in memory: autograd accumulates straight into
the bucket. A parameter's ``.grad`` becomes its slot when the buckets are
built (and rebuilt: a gradient kept across a rebuild moves into its new
slot), or, after ``zero_grad(set_to_none=True)`` made autograd allocate a
fresh ``.grad``, at its hook: copied into the slot at once, so its memory
goes back at once (as torch's reducer does). Only for a dense gradient in a
bucket of the parameter's own dtype (not with ``reduce_dtype``).

A gradients part, :class:`BucketViews`: :class:`~minddp.ddp.parts.gradient_cases.GradientCases`
with its views on. ZeRO stage 2 chooses it too (its pool's buffers take
each gradient at its hook).
"""

from __future__ import annotations

from minddp.ddp.parts.gradient_cases import GradientCases

__all__ = ["BucketViews"]


class BucketViews(GradientCases):
    """Gradients as views into the buckets (``never``: parameter indices whose gradients are sparse)."""

    def __init__(self, count: int, never: frozenset[int] = frozenset()):
        super().__init__(count)
        self.never = never

    def buckets_built(self, reducer) -> None:
        plan = [(bucket, position) for bucket in reducer.buckets for position in range(len(bucket.params))]
        for bucket, position in plan:
            index, p = bucket.indices[position], bucket.params[position]
            self.as_view[index] = bucket.dtype == p.dtype and index not in self.never and index not in self.sparse_dim
            if p.grad is not None and self.as_view[index] and bucket.buffer is not None:
                p.grad = bucket.views[position].copy_(p.grad)  # kept across a rebuild: into its new slot

    def gradient_ready(self, bucket, position: int, param) -> None:
        index = bucket.indices[position]
        if self.as_view[index] and (grad := param.grad) is not None and not grad.is_sparse:
            if bucket.buffer is None:  # a storage that lends buffers: the bucket's first use this backward
                bucket.acquire()
            if grad is not (slot := bucket.views[position]):
                # After zero_grad(set_to_none=True) autograd made a fresh .grad: into its slot now, so
                # its memory goes back at once, not when the whole bucket is complete (as torch's
                # reducer; batching these copies per bucket measured no faster, and held up to a
                # bucket of gradients twice).
                param.grad = slot.copy_(grad)
