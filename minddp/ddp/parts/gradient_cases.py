"""Gradients that are not a plain dense copy: missing, sparse, or already in their slot.

The plain gradients part (:class:`~minddp.ddp.core.reducer.CopyGradients`) copies
every ``p.grad`` of a complete bucket into its slot and, at the end of
backward, every average back. :class:`GradientCases` decides per gradient,
and copies the rest in one batch each way as the plain part does:

* no gradient (``find_unused_parameters``, ``static_graph``): the slot
  holds zeros; a parameter unused on every rank keeps its ``.grad`` (None
  stays None), the others get the average;
* a sparse gradient (torch's test: ``nn.Embedding`` / ``nn.EmbeddingBag``
  with ``sparse=True``): densified into the slot, every row travels, and
  ``.grad`` comes back sparse;
* a gradient that *is* its slot (``gradient_as_bucket_view``, whose part
  :mod:`~minddp.ddp.parts.bucket_views` holds one of these and sets
  ``as_view``): nothing to copy either way.
"""

from __future__ import annotations

import torch

from minddp.ddp.core.buckets import Bucket
from minddp.ddp.core.slots import GradientTransfer

__all__ = ["GradientCases", "sparse_embedding_weights"]


def sparse_embedding_weights(module: torch.nn.Module) -> set[int]:
    """``id`` of the weights whose gradients come sparse (torch's DDP asks the same question)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


class GradientCases(GradientTransfer):
    """Gradients in and out, case by case: missing, sparse, or already a bucket view (``count``: parameters)."""

    def __init__(self, count: int):
        self.as_view = [False] * count  # .grad is its bucket slot (set by minddp.ddp.parts.bucket_views)
        self.sparse_dim: dict[int, int] = {}  # parameters whose gradients came sparse

    def buckets_built(self, reducer) -> None: ...
    def gradient_ready(self, bucket: Bucket, position: int, param) -> None: ...

    def fill_bucket(self, bucket: Bucket, scale: float) -> None:
        grads, slots = [], []
        for index, param, slot in zip(bucket.indices, bucket.params, bucket.views):
            if not self._fill_case(index, param, slot):
                grads.append(param.grad)
                slots.append(slot)
        bucket.copy_in(grads, slots, scale)  # the plain copies (a cast, with reduce_dtype); every slot scaled
        for index, param, slot in zip(bucket.indices, bucket.params, bucket.views):
            grad = param.grad  # copied: only now a view, .grad held the gradient until the copy
            if self.as_view[index] and grad is not None and grad is not slot and not grad.is_sparse:
                param.grad = slot  # e.g. after zero_grad(set_to_none=True)

    def _fill_case(self, index: int, param, slot: torch.Tensor) -> bool:
        """Fill ``slot`` if ``param``'s gradient is a case of its own; False: a plain copy."""
        grad = param.grad
        if grad is slot:  # .grad already lives in the bucket (gradient_as_bucket_view)
            return True
        if grad is None:  # unused here (but maybe used on another rank): contributes zero
            slot.zero_()
            return True
        if grad.is_sparse:  # densified: every row travels, touched or not
            self.sparse_dim[index] = grad.sparse_dim()
            slot.zero_().add_(grad)
            return True
        return False

    def write_grads(self, bucket: Bucket, used: list[bool] | None) -> None:
        grads, slots = [], []
        for index, param, slot in zip(bucket.indices, bucket.params, bucket.views):
            if used is not None and not used[index]:
                continue  # unused on every rank: .grad stays as it was (None stays None)
            if not self._write_case(index, param, slot):
                grads.append(param.grad)
                slots.append(slot)
        if grads:
            torch._foreach_copy_(grads, slots)  # casts too, with reduce_dtype

    def _write_case(self, index: int, param, slot: torch.Tensor) -> bool:
        """Write ``param.grad`` from ``slot`` if it is a case of its own; False: a plain copy."""
        if param.grad is slot:
            return True  # gradient_as_bucket_view: the average is already in .grad
        if index in self.sparse_dim:
            param.grad = slot.to(param.dtype).to_sparse(self.sparse_dim[index])
        elif self.as_view[index]:
            param.grad = slot
        elif param.grad is None:
            param.grad = slot.to(param.dtype, copy=True)
        else:
            return False
        return True
