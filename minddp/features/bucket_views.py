"""``gradient_as_bucket_view=True``: each ``.grad`` *is* its slot in the bucket.

No copy into the bucket before the all-reduce and none back after it, and no
second copy of all gradients in memory: autograd accumulates straight into
the bucket. A parameter's ``.grad`` becomes its slot when the buckets are
built (and rebuilt: a gradient kept across a rebuild moves into its new
slot), or, after ``zero_grad(set_to_none=True)`` made autograd allocate a
fresh ``.grad``, at its hook: copied into the slot at once, so its memory
goes back at once (as torch's reducer does). Only for a dense gradient in a
bucket of the parameter's own dtype (not with ``reduce_dtype``).
"""

from __future__ import annotations

from minddp.features import Layer
from minddp.features.gradient_cases import GradientCases

__all__ = ["BucketViews"]


class BucketViews(Layer):
    height = 3

    def attach(self, sparse: frozenset[int] = frozenset()) -> None:
        self.add_layer(GradientCases)
        self._never_views = sparse  # parameters whose gradients are sparse: never a view
        self._build_buckets(self.layout_order)

    def detach(self) -> None:
        self._as_view = [False] * len(self.params)

    def _build_buckets(self, order: list[int]) -> None:
        super()._build_buckets(order)
        self._as_view = [self._plan[i][0].dtype == p.dtype and i not in self._never_views and i not in self._sparse_dim
                         for i, p in enumerate(self.params)]
        for i, p in enumerate(self.params):  # gradients kept across a rebuild move into their new slots
            if p.grad is not None and self._as_view[i] and self._plan[i][0].buffer is not None:
                p.grad = self._plan[i][0].views[self._plan[i][1]].copy_(p.grad)

    def on_grad_ready(self, index: int, param) -> None:
        if self._as_view[index] and (grad := param.grad) is not None and not grad.is_sparse:
            bucket, position = self._plan[index]
            if bucket.buffer is None:  # a storage that lends buffers: the bucket's first use this backward
                bucket.acquire()
            if grad is not (slot := bucket.views[position]):
                # After zero_grad(set_to_none=True) autograd made a fresh .grad: into its slot now, so
                # its memory goes back at once, not when the whole bucket is complete (as torch's
                # reducer; batching these copies per bucket measured no faster, and held up to a
                # bucket of gradients twice).
                param.grad = slot.copy_(grad)
        super().on_grad_ready(index, param)
