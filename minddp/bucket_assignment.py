"""Which parameters travel together: gradient buckets assigned by size, and each gradient's slot.

:func:`assign_buckets` is a pure function from parameter sizes to groups of
indices. Every rank calls it on the same model and gets the same answer,
which is what keeps collectives matched across ranks. :func:`slot_in` lays
out one gradient's slot in its bucket's buffer. (One bucket's buffer and
life cycle are in :mod:`minddp.buckets`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["TensorSpec", "assign_buckets", "slot_in", "MiB", "FIRST_BUCKET_CAP_MB"]

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
