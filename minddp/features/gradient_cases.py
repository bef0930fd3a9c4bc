"""Gradients that are not a plain dense copy: none, sparse, or already in their slot.

The plain path copies every ``p.grad`` of a complete bucket into its slot
and, at the end of backward, every average back. Three features break that
assumption, and this layer is where a gradient's case is decided, per
gradient, only when one of them is on:

* no gradient (``find_unused_parameters``, ``static_graph``): the slot
  holds zeros, the parameter counts as unused on this rank, and a
  parameter unused on every rank keeps its ``.grad`` (None stays None);
* a sparse gradient (``nn.Embedding(..., sparse=True)``): densified into
  the slot, every row travels, and ``.grad`` comes back sparse;
* a gradient that *is* its slot (``gradient_as_bucket_view``): nothing to
  copy either way.

Stacked by :mod:`~minddp.features.unused_parameters`,
:mod:`~minddp.features.static_graph`, :mod:`~minddp.features.bucket_views`,
and by MiniDDP for a module with sparse embeddings (torch's test:
``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minddp.features import Layer

__all__ = ["GradientCases", "sparse_embedding_weights"]


def sparse_embedding_weights(module: torch.nn.Module) -> set[int]:
    """``id`` of the weights whose gradients come sparse (torch's DDP asks the same question)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


class GradientCases(Layer):
    height = 1  # the lowest: its fill and write replace the plain ones; other layers wrap them

    def attach(self) -> None:
        n = len(self.params)
        self._as_view = [False] * n  # .grad is its bucket slot (minddp.features.bucket_views)
        self._sparse_dim: dict[int, int] = {}  # parameters whose gradients came sparse
        self._locally_used = [True] * n  # did this rank's backward give it a gradient?

    def start_backward(self) -> None:
        self._locally_used = [True] * len(self.params)
        super().start_backward()

    def fill_bucket(self, bucket) -> None:
        grads, slots, copied = [], [], []
        for index, param, slot in zip(self._indices[bucket.index], bucket.params, bucket.views):
            grad = param.grad
            if grad is slot:  # .grad already lives in the bucket (gradient_as_bucket_view)
                continue
            if grad is None:  # unused here (but maybe used on another rank): contributes zero
                self._locally_used[index] = False
                slot.zero_()
            elif grad.is_sparse:  # densified: every row travels, touched or not
                self._sparse_dim[index] = grad.sparse_dim()
                slot.zero_().add_(grad)
            else:  # a copy (a cast, with reduce_dtype)
                grads.append(grad)
                slots.append(slot)
                copied.append(index)
        bucket.copy_in(grads, slots, self.scale)
        for index, slot in zip(copied, slots):  # only now: .grad held the gradient until the copy
            if self._as_view[index]:  # e.g. after zero_grad(set_to_none=True)
                self.params[index].grad = slot

    def write_grads(self, bucket) -> None:
        bucket.wait()
        used = self.globally_used
        grads, slots = [], []
        for index, p, slot in zip(self._indices[bucket.index], bucket.params, bucket.views):
            if used is not None and not used[index]:
                continue  # unused on every rank: .grad stays as it was (None stays None)
            if p.grad is slot:
                continue  # gradient_as_bucket_view: the average is already in .grad
            if index in self._sparse_dim:
                p.grad = slot.to(p.dtype).to_sparse(self._sparse_dim[index])
            elif self._as_view[index]:
                p.grad = slot
            elif p.grad is None:
                p.grad = slot.to(p.dtype, copy=True)
            else:
                grads.append(p.grad)
                slots.append(slot)
        if grads:
            torch._foreach_copy_(grads, slots)  # casts too, with reduce_dtype

    def _used_on_any_rank(self, used_here: list[bool]) -> list[bool]:
        """Which parameters got a gradient on some rank (one small all-reduce)."""
        used = torch.tensor(used_here, dtype=torch.int32, device=self.device)
        dist.all_reduce(used, group=self.process_group)
        return [bool(u) for u in used.tolist()]

    def _mark_all_unready(self) -> None:
        """Count every parameter still without a gradient as ready (its slot: zeros), in bucket order."""
        for bucket in self.buckets:
            for p in bucket.unready_params():
                self._mark_ready(self._index[p])

    def _mark_ready(self, index: int) -> None:
        bucket, position = self._plan[index]
        if bucket.mark_ready_at(position):
            self.bucket_ready(bucket)
