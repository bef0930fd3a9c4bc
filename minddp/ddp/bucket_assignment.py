"""Which parameters travel together, in which order: buckets assigned by size, the order learned, each slot.

:func:`assign_buckets` is a pure function from parameter sizes to groups of
indices. Every rank calls it on the same model and gets the same answer,
which is what keeps collectives matched across ranks. Where a bucket's
buffer comes from (:class:`BucketStorage`) and where each gradient's slot
lies in it (:func:`slot_in`) are here too; one bucket's life cycle is in
:mod:`minddp.ddp.buckets`.

:class:`LearnedBucketOrder`, buckets in the order gradients really arrive
(torch's DDP does this): a guess at the order gradients come in (reverse
registration: the last layer registered is the first whose gradient is
ready) breaks on a model that registers its layers in another order than
it runs them (a head defined before the body, a module reused): a bucket
then waits for one late gradient while its others are long done, and
launches late. So, as torch's DDP since 2.14, the first backward sends all
gradients in one bucket (:func:`first_guess_buckets`), and the buckets are
then rebuilt once, in the order the gradients came, before the next forward.
Every rank must build the same buckets (they are what keeps collectives
matched), so rank 0's order is broadcast and everyone uses it. A
:class:`~minddp.ddp.contracts.Policy` on the reducer's interface, like the
lab's bucket planner (``minddp_lab.auto.plan_buckets``): it adds an arrival log to the reducer's
observers, is told the end of the backward (``after_backward``), and calls
``rebuild``; until then its ``pending_rebuild`` is ``Rebuild.ORDER_TO_LEARN``.
"""

from __future__ import annotations

from dataclasses import dataclass
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from minddp.ddp.contracts import Policy, Rebuild

__all__ = ["TensorSpec", "assign_buckets", "bucket_groups", "first_guess_buckets", "first_guess_limits", "size_limits",
           "BucketStorage", "slot_in", "LearnedBucketOrder", "MiB", "FIRST_BUCKET_CAP_MB"]

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


class BucketStorage:
    """Where bucket buffers come from: one per bucket, kept for the whole run (torch's way). ZeRO
    stage 2 and ``lazy_bucket_allocation`` lend them instead (:mod:`minddp.ddp.parts.lent_buckets`)."""

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


class LearnedBucketOrder(Policy):
    """Rebuild ``reducer``'s buckets once, in rank 0's arrival order in its first backward, with its caps
    (until then, torch's first guess: one bucket): the order is agreed at the end of that backward, the
    buckets are rebuilt at the next synchronized forward (``Reducer.rebuild``). With ``static_graph`` after
    its second backward, as torch does: the first one only counts each parameter's hooks
    (:mod:`minddp.ddp.parts.static_graph`)."""

    def __init__(self, reducer, arrivals):
        self.reducer, self.arrivals = reducer, arrivals  # arrivals: the reducer's ArrivalLog, a fresh one
        self.backwards_to_skip = 1 if reducer.options.static_graph else 0
        self.learned = False
        reducer.add_observer(self.arrivals)
        reducer.add_policy(self)

    def pending_rebuild(self) -> Rebuild:
        return Rebuild.NONE if self.learned else Rebuild.ORDER_TO_LEARN

    def after_backward(self) -> None:
        if self.backwards_to_skip:  # the same on every rank: each takes part in the broadcast below
            self.backwards_to_skip -= 1
            return
        reducer = self.reducer
        reducer.remove_observer(self.arrivals)
        reducer.remove_policy(self)
        arrived = list(dict.fromkeys(i for i, _ in self.arrivals.log))
        seen = set(arrived)  # parameters that got no gradient keep the guess: reverse registration
        order = arrived + [i for i in reversed(range(len(reducer.params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=reducer.device)
        rank0 = dist.get_process_group_ranks(reducer.process_group)[0]  # a global rank, as broadcast wants
        dist.broadcast(order_t, src=rank0, group=reducer.process_group)
        self.learned = True
        reducer.rebuild(order_t.tolist(), *reducer.caps)  # always: the caps change too (one bucket until now)
