"""Which parameters travel together, in which order: buckets assigned by size, the order learned, each slot.

:func:`assign_buckets` is a pure function from parameter sizes to groups of
indices. Every rank calls it on the same model and gets the same answer,
which is what keeps collectives matched across ranks. Where a bucket's
buffer comes from (:class:`BucketStorage`) and where each gradient's slot
lies in it (:func:`slot_in`) are here too; one bucket's life cycle is in
:mod:`minddp.buckets`.

:class:`LearnedBucketOrder`, buckets in the order gradients really arrive
(torch's DDP does this): the reducer first buckets parameters in reverse
registration order, a guess that the last layer registered is the first
whose gradient is ready. A model that registers its layers in another
order than it runs them (a head defined before the body, a module reused)
breaks the guess, and a bucket then waits for one late gradient while its
others are long done, and launches late. So after the first synchronized
backward the buckets are rebuilt once, in the order the gradients came.
Every rank must build the same buckets (they are what keeps collectives
matched), so rank 0's order is broadcast and everyone uses it. A policy on
the reducer's interface, like ``bucket_cap_mb="auto"``
(:mod:`minddp.bucket_planner`): it adds an arrival log to the reducer's
observers, is called at the end of the backward
(``backward_done_callbacks``), and calls ``rebuild``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["TensorSpec", "assign_buckets", "BucketStorage", "slot_in", "LearnedBucketOrder", "MiB", "FIRST_BUCKET_CAP_MB"]

MiB = 1024 * 1024
# torch's DDP caps the first bucket at 1 MiB so the first all-reduce starts early.
FIRST_BUCKET_CAP_MB = 1.0


@dataclass(frozen=True)
class TensorSpec:
    """What bucketing needs to know about a parameter: size and where it lives."""

    numel: int
    element_size: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(t.numel(), t.element_size(), t.dtype, t.device)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def assign_buckets(
    specs: Sequence[TensorSpec], cap_bytes: int, first_cap_bytes: int | None = None,
    per_bucket_caps: Sequence[int] = (),
) -> list[list[int]]:
    """Group tensor indices into buckets of at most ``cap_bytes`` each.

    ``specs`` come in the order gradients are expected to arrive (MiniDDP
    passes the parameters in *reverse* registration order: the last layer's
    gradient is computed first). Rules:

    * a bucket holds one dtype on one device (it is a single flat tensor), so
      each (dtype, device) pair fills its own open bucket;
    * a tensor joins the open bucket unless that would pass the cap; a tensor
      larger than the cap gets a bucket of its own (so a cap of 0 means one
      tensor per bucket, as in torch's DDP);
    * the first bucket of each (dtype, device) may have a smaller cap
      (``first_cap_bytes``; torch's DDP uses 1 MiB) so that the first
      all-reduce starts early in backward;
    * ``per_bucket_caps`` (torch's ``bucket_cap_mb_list``), when given,
      replace both: the k-th bucket of each (dtype, device) has cap
      ``per_bucket_caps[k]``, the last one for every bucket after;
    * buckets are ordered by the position of their first tensor, which is
      the order they become ready in, and the order they are launched in.
    """
    if cap_bytes < 0:
        raise ValueError(f"bucket cap must be >= 0 bytes (0: one tensor per bucket), got {cap_bytes}")
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_per_key: dict[tuple, int] = {}
    closed: list[list[int]] = []

    for index, spec in enumerate(specs):
        key = (spec.dtype, spec.device)
        cap = cap_bytes
        if per_bucket_caps:
            cap = per_bucket_caps[min(closed_per_key.get(key, 0), len(per_bucket_caps) - 1)]
        elif first_cap_bytes is not None and closed_per_key.get(key, 0) == 0:
            cap = min(cap_bytes, first_cap_bytes)
        bucket = open_buckets.setdefault(key, [])
        if bucket and open_bytes[key] + spec.nbytes > cap:
            closed.append(bucket)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            bucket = open_buckets[key] = []
            open_bytes[key] = 0
        bucket.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + spec.nbytes
    closed.extend(b for b in open_buckets.values() if b)
    return sorted(closed, key=lambda b: b[0])


class BucketStorage:
    """Where bucket buffers come from: one per bucket, kept for the whole run (torch's way). ZeRO
    stage 2 and ``lazy_bucket_allocation`` lend them instead (:mod:`minddp.features.lent_buckets`)."""

    keep_buffers = True
    release_after_backward = False  # give a buffer back once its averages are in .grad

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        pass


def slot_in(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """``param``'s slot in ``buffer`` from ``offset``, laid out in memory like ``param`` (as torch's reducer).

    A ``channels_last`` weight's ``.grad`` has the weight's strides (autograd's rule), and so must
    its slot: a bucket view used as ``.grad`` then suits fused optimizers (which walk parameter and
    gradient as flat memory), and a copy into the slot is a plain copy, not a permutation.
    """
    if _dense_and_non_overlapping(param):
        return buffer.as_strided(param.shape, param.stride(), offset)
    return buffer[offset : offset + param.numel()].view(param.shape)


def _dense_and_non_overlapping(t: torch.Tensor) -> bool:
    """Do ``t``'s elements fill ``numel`` consecutive places, in some order of its dims?"""
    expected = 1
    dims = sorted(((size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1), key=lambda d: d[1])
    for size, stride in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class LearnedBucketOrder:
    """Rebuild ``reducer``'s buckets once, after its first backward, in rank 0's arrival order."""

    def __init__(self, reducer, arrivals):
        self.reducer, self.arrivals = reducer, arrivals  # arrivals: the reducer's ArrivalLog, a fresh one
        reducer.add_observer(self.arrivals)
        reducer.backward_done_callbacks.append(self.after_first_backward)

    def after_first_backward(self) -> None:
        reducer = self.reducer
        reducer.remove_observer(self.arrivals)
        reducer.backward_done_callbacks.remove(self.after_first_backward)
        arrived = list(dict.fromkeys(i for i, _ in self.arrivals.log))
        seen = set(arrived)  # parameters that got no gradient keep the guess: reverse registration
        order = arrived + [i for i in reversed(range(len(reducer.params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=reducer.device)
        rank0 = dist.get_process_group_ranks(reducer.process_group)[0]  # a global rank, as broadcast wants
        dist.broadcast(order_t, src=rank0, group=reducer.process_group)
        order = order_t.tolist()
        if order != reducer.bucket_order:
            reducer.rebuild(order, *reducer.caps)
