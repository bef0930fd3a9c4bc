"""Gradients that are not a plain dense copy: none, sparse, or already in their slot.

The plain gradients part (:class:`~minddp.reducer.CopyGradients`) copies
every ``p.grad`` of a complete bucket into its slot and, at the end of
backward, every average back. :class:`GradientCases` decides per gradient,
for a module with sparse embeddings (torch's test: ``nn.Embedding`` /
``nn.EmbeddingBag`` with ``sparse=True``) and under ``gradient_as_bucket_view``
(:mod:`~minddp.features.bucket_views`, its subclass):

* no gradient (as :class:`~minddp.features.unused_parameters.MissingGradients`):
  the slot holds zeros; a parameter unused on every rank keeps its ``.grad``;
* a sparse gradient: densified into the slot, every row travels, and
  ``.grad`` comes back sparse;
* a gradient that *is* its slot (``gradient_as_bucket_view``): nothing to
  copy either way.
"""

from __future__ import annotations

import torch

from minddp.features.unused_parameters import MissingGradients

__all__ = ["GradientCases", "sparse_embedding_weights"]


def sparse_embedding_weights(module: torch.nn.Module) -> set[int]:
    """``id`` of the weights whose gradients come sparse (torch's DDP asks the same question)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


class GradientCases(MissingGradients):
    """Gradients in and out, case by case: missing, sparse, or already a bucket view."""

    def __init__(self, count: int):
        self.as_view = [False] * count  # .grad is its bucket slot (set by minddp.features.bucket_views)
        self.sparse_dim: dict[int, int] = {}  # parameters whose gradients came sparse

    def fill_bucket(self, bucket, scale: float) -> None:
        grads, slots, copied = [], [], []
        for index, param, slot in zip(bucket.indices, bucket.params, bucket.views):
            grad = param.grad
            if grad is slot:  # .grad already lives in the bucket (gradient_as_bucket_view)
                continue
            if grad is None:  # unused here (but maybe used on another rank): contributes zero
                slot.zero_()
            elif grad.is_sparse:  # densified: every row travels, touched or not
                self.sparse_dim[index] = grad.sparse_dim()
                slot.zero_().add_(grad)
            else:  # a copy (a cast, with reduce_dtype)
                grads.append(grad)
                slots.append(slot)
                copied.append((param, index))
        bucket.copy_in(grads, slots, scale)
        for (param, index), slot in zip(copied, slots):  # only now: .grad held the gradient until the copy
            if self.as_view[index]:  # e.g. after zero_grad(set_to_none=True)
                param.grad = slot

    def write_grads(self, bucket, used: list[bool] | None) -> None:
        grads, slots = [], []
        for index, p, slot in zip(bucket.indices, bucket.params, bucket.views):
            if used is not None and not used[index]:
                continue  # unused on every rank: .grad stays as it was (None stays None)
            if p.grad is slot:
                continue  # gradient_as_bucket_view: the average is already in .grad
            if index in self.sparse_dim:
                p.grad = slot.to(p.dtype).to_sparse(self.sparse_dim[index])
            elif self.as_view[index]:
                p.grad = slot
            elif p.grad is None:
                p.grad = slot.to(p.dtype, copy=True)
            else:
                grads.append(p.grad)
                slots.append(slot)
        if grads:
            torch._foreach_copy_(grads, slots)  # casts too, with reduce_dtype
