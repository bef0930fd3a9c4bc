"""Which parameters travel together, in which order: buckets assigned by size, and torch's first guess.

:func:`assign_buckets` is a pure function from parameter sizes to groups of
indices. Every rank calls it on the same model and gets the same answer,
which is what keeps collectives matched across ranks. One bucket's buffer
and life cycle are in :mod:`minddp.ddp.core.buckets`.

Before a backward has shown the order gradients arrive in, torch guesses
(:func:`first_guess_buckets`); the order learned from the first backward is a
policy outside the core (:class:`minddp.ddp.policies.LearnedBucketOrder`).
"""

from __future__ import annotations

from dataclasses import dataclass
import sys
from typing import Sequence

import torch

__all__ = ["TensorSpec", "assign_buckets", "bucket_groups", "first_guess_buckets", "first_guess_limits", "size_limits",
           "MiB", "FIRST_BUCKET_CAP_MB"]

MiB = 1024 * 1024
# torch's DDP caps the first bucket at 1 MiB so the first all-reduce starts early (``dist._DEFAULT_FIRST_BUCKET_BYTES``),
# unless a cap was given (bucket_cap_mb or bucket_cap_mb_list).
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


def size_limits(cap_bytes: int, first_cap_bytes: int | None = None, per_bucket_caps: Sequence[int] = ()) -> list[int]:
    """torch's list of bucket size limits: the k-th bucket of each (dtype, device) gets ``limits[k]``,
    the last one every bucket after. ``per_bucket_caps`` (``bucket_cap_mb_list``) when given; else a
    smaller first limit (``first_cap_bytes``) only where it is smaller than the cap."""
    if per_bucket_caps:
        return list(per_bucket_caps)
    if first_cap_bytes is not None and first_cap_bytes < cap_bytes:
        return [first_cap_bytes, cap_bytes]
    return [cap_bytes]


def assign_buckets(
    specs: Sequence[TensorSpec], cap_bytes: int, first_cap_bytes: int | None = None,
    per_bucket_caps: Sequence[int] = (),
) -> list[list[int]]:
    """Group tensor indices into buckets by size, as torch's ``compute_bucket_assignment_by_size``.

    ``specs`` come in the order gradients are expected to arrive (MiniDDP
    passes them in the order the first backward delivered them). Rules:

    * a bucket holds one dtype on one device (it is a single flat tensor), so
      each (dtype, device) pair fills its own open bucket;
    * a tensor joins the open bucket, and the bucket closes as soon as it
      holds its limit or more: a bucket passes its cap by at most its last
      tensor (so a cap of 0 means one tensor per bucket, as in torch's DDP);
    * the limits are :func:`size_limits`: the first bucket of each (dtype,
      device) may have a smaller one (``first_cap_bytes``; torch's default
      1 MiB) so that the first all-reduce starts early in backward, and
      ``per_bucket_caps`` (torch's ``bucket_cap_mb_list``) replace both;
    * buckets come in the order they closed (the order they become ready and
      are launched in), then the ones left open.
    """
    if cap_bytes < 0:
        raise ValueError(f"bucket cap must be >= 0 bytes (0: one tensor per bucket), got {cap_bytes}")
    limits = size_limits(cap_bytes, first_cap_bytes, per_bucket_caps)
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_per_key: dict[tuple, int] = {}
    closed: list[list[int]] = []

    for index, spec in enumerate(specs):
        key = (spec.dtype, spec.device)
        limit = limits[min(closed_per_key.get(key, 0), len(limits) - 1)]
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + spec.nbytes
        if open_bytes[key] >= limit:
            closed.append(open_buckets.pop(key))
            open_bytes[key] = 0
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
    return closed + list(open_buckets.values())


def first_guess_buckets(specs: Sequence[TensorSpec], limits: Sequence[int]) -> list[list[int]]:
    """torch's buckets before a backward has shown the order gradients arrive in: assigned over the
    parameters in registration order (``specs``), each bucket's indices ascending, the bucket of the
    last-registered parameters launched first."""
    groups = assign_buckets(specs, limits[-1], per_bucket_caps=limits)
    return sorted(groups, key=min, reverse=True)


def first_guess_limits(caps: tuple[int, int | None], per_bucket_caps: Sequence[int], options) -> list[int]:
    """torch's limits for the first buckets: one bucket (per dtype) until the first rebuild, unless the
    buckets will never be rebuilt (``find_unused_parameters`` without ``static_graph``: ``options``, the
    reducer's) or caps per bucket were given."""
    if per_bucket_caps:
        return list(per_bucket_caps)
    if options.static_graph or not options.find_unused_parameters:
        return [sys.maxsize]
    return size_limits(*caps)


def bucket_groups(specs: Sequence[TensorSpec], order: Sequence[int] | None, caps: tuple[int, int | None],
                  per_bucket_caps: Sequence[int], first_guess: Sequence[int]) -> list[list[int]]:
    """Parameter indices per bucket, in launch order: by ``caps`` over the expected-arrival ``order``,
    or, with ``order`` None, torch's first guess (limits ``first_guess``) over ``specs`` in registration order."""
    if order is None:
        return first_guess_buckets(specs, first_guess)
    groups = assign_buckets([specs[i] for i in order], *caps, per_bucket_caps=per_bucket_caps)
    return [[order[j] for j in group] for group in groups]
