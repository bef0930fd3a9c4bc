"""Gradients that are not a plain dense copy: none, sparse, or already in their slot.

The plain gradients part (:class:`~minddp.ddp.reducer.CopyGradients`) copies
every ``p.grad`` of a complete bucket into its slot and, at the end of
backward, every average back. :class:`GradientCases` decides per gradient,
for a module with sparse embeddings (torch's test: ``nn.Embedding`` /
``nn.EmbeddingBag`` with ``sparse=True``) and under ``gradient_as_bucket_view``
(:mod:`~minddp.ddp.parts.bucket_views`, its subclass):

* no gradient (as :class:`~minddp.ddp.parts.unused_parameters.MissingGradients`):
  the slot holds zeros; a parameter unused on every rank keeps its ``.grad``;
* a sparse gradient: densified into the slot, every row travels, and
  ``.grad`` comes back sparse;
* a gradient that *is* its slot (``gradient_as_bucket_view``): nothing to
  copy either way.
"""

from __future__ import annotations

import torch

from minddp.ddp.parts.unused_parameters import MissingGradients

__all__ = ["GradientCases", "sparse_embedding_weights"]


def sparse_embedding_weights(module: torch.nn.Module) -> set[int]:
    """``id`` of the weights whose gradients come sparse (torch's DDP asks the same question)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


class GradientCases(MissingGradients):
    """Gradients in and out, case by case: missing, sparse, or already a bucket view."""

    def __init__(self, count: int):
        self.as_view = [False] * count  # .grad is its bucket slot (set by minddp.ddp.parts.bucket_views)
        self.sparse_dim: dict[int, int] = {}  # parameters whose gradients came sparse

    def fill_case(self, index: int, param, slot) -> bool:
        grad = param.grad
        if grad is slot:  # .grad already lives in the bucket (gradient_as_bucket_view)
            return True
        if grad is not None and grad.is_sparse:  # densified: every row travels, touched or not
            self.sparse_dim[index] = grad.sparse_dim()
            slot.zero_().add_(grad)
            return True
        return super().fill_case(index, param, slot)  # a missing one; else a copy (a cast, with reduce_dtype)

    def fill_bucket(self, bucket, scale: float) -> None:
        super().fill_bucket(bucket, scale)
        for index, param, slot in zip(bucket.indices, bucket.params, bucket.views):
            grad = param.grad  # copied: only now a view, .grad held the gradient until the copy
            if self.as_view[index] and grad is not None and grad is not slot and not grad.is_sparse:
                param.grad = slot  # e.g. after zero_grad(set_to_none=True)

    def write_case(self, index: int, param, slot) -> bool:
        if param.grad is slot:
            return True  # gradient_as_bucket_view: the average is already in .grad
        if index in self.sparse_dim:
            param.grad = slot.to(param.dtype).to_sparse(self.sparse_dim[index])
        elif self.as_view[index]:
            param.grad = slot
        else:
            return super().write_case(index, param, slot)  # a missing one; else a copy
        return True
