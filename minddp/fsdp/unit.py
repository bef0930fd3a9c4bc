"""One unit: the parameters of one ``fully_shard`` call, kept as one flat shard per rank.

A unit lays its parameters end to end (a :class:`~minddp.zero.partition.FlatUnit`)
and keeps only this rank's piece: ``shard``, one contiguous tensor in the
parameters' own dtype (fp32). The module's parameters are replaced by views
into it, so ``named_parameters()`` keeps its names and an optimizer steps
the pieces in place.

Around a forward or backward the unit is *gathered*: every rank's piece,
cast to the compute dtype, lands in ``full`` (N pieces end to end), and each
parameter is seen by the module as a tensor over ``full``'s storage. Those
tensors (``full_params``) are created once and kept for the unit's whole life;
*freeing* the unit shrinks the storage to zero bytes and gathering grows it
back. Keeping the same tensor objects is what lets autograd find them again:
the graph of a forward holds them, and in backward their storage is simply
full again. Their gradients arrive on them (``.grad``, full size, compute
dtype), accumulated by autograd straight into their places in the unit's
send buffer (:meth:`gradients_into_send_buffer`, before the unit's
backward); :meth:`start_reduce_scatter` divides that buffer by N and sums it
over the ranks into this rank's piece, and :meth:`finish_reduce_scatter`
hands the piece, in fp32, to the shard parameters' ``.grad``.

Life cycle: ``SHARDED -> (start_gather) GATHERING -> (wait_gathered) GATHERED
-> (free) SHARDED``; a reduce-scatter runs beside it (``pending``).
"""

from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from minddp.ddp.core.weak_hooks import after_accumulation
from minddp.fsdp.collectives import PendingReduceScatter, all_gather, gloo_collectives, start_reduce_scatter
from minddp.fsdp.policy import MixedPrecisionPolicy
from minddp.zero.partition import FlatUnit

__all__ = ["Place", "ShardedUnit", "UnitState"]

Place = tuple[nn.Module, str]  # where a parameter is registered: (module, attribute name)


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedUnit:
    """A flat shard of some parameters, and the collectives that gather and reduce it."""

    def __init__(self, name: str, params: list[nn.Parameter], places: list[list[Place]],
                 group: dist.ProcessGroup, policy: MixedPrecisionPolicy,
                 on_gradient: Callable[["ShardedUnit"], None],
                 lend_buffer: Callable[["ShardedUnit"], torch.Tensor] | None = None):
        """``params``: the unit's own parameters (distinct); ``places[i]``: where ``params[i]`` sits."""
        self.name = name
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.places = places
        self.state = UnitState.SHARDED
        self.requires_gradient_sync = True
        self.borrowed: list[tuple[Place, "ShardedUnit", int]] = []  # tied parameters owned by another unit
        self.reshard_after_forward = True
        self.is_root = False  # around other units: kept gathered from its forward into backward
        self.schedule = None  # the Schedule of the model's units, set by fully_shard
        self._on_gradient = on_gradient
        self._lend_buffer = lend_buffer or _own_buffer  # this step's send buffer, zeros (the Schedule lends one)
        self._send: torch.Tensor | None = None  # this step's gradients, end to end (reduce dtype)
        self._gather_work = None
        self.pending: PendingReduceScatter | None = None  # a launched reduce-scatter, until waited for
        self.gradients_in = 0
        self.gathers = self.reduce_scatters = 0  # collectives launched so far (for tests and lessons)
        with torch.no_grad():
            self._lay_out([p.detach() for p in params], [p.requires_grad for p in params], policy)

    def _lay_out(self, originals: list[torch.Tensor], trained: list[bool], policy: MixedPrecisionPolicy) -> None:
        self.layout = FlatUnit(originals, self.world_size) if originals else None
        self.master_dtype = originals[0].dtype if originals else torch.float32
        device = originals[0].device if originals else torch.device("cpu")
        self.compute_dtype = policy.compute_dtype(self.master_dtype)
        self.on_gloo = gloo_collectives(self.group, device)
        self.reduce_dtype = policy.communication_dtype(self.master_dtype)
        piece = self.layout.piece if self.layout else 0
        start = self.layout.ranges[self.rank][0] if self.layout else 0
        end = self.layout.ranges[self.rank][1] if self.layout else 0
        self.shard = self.layout.read(self.rank, 0, piece, lambda p: p) if self.layout else torch.empty(0)
        self._take_rank0s_pieces()
        self.spans: list[tuple[int, int]] = []  # per parameter: (first element this rank holds, how many)
        self.shard_params: list[nn.Parameter] = []
        self.full = torch.empty(self.world_size * piece, dtype=self.compute_dtype, device=device)
        self.full_params: list[torch.Tensor] = []
        for original, requires_grad, offset in zip(originals, trained, self.layout.offsets if self.layout else []):
            lo, hi = max(offset, start), min(offset + original.numel(), end)
            length = max(0, hi - lo)
            self.spans.append((lo - offset if length else 0, length))
            view = self.shard[lo - start: lo - start + length] if length else self.shard[0:0]
            self.shard_params.append(nn.Parameter(view, requires_grad=requires_grad))
            over_full = torch.empty(0, dtype=self.compute_dtype, device=device)
            over_full.set_(self.full.untyped_storage(), offset, original.shape, _contiguous_strides(original.shape))
            over_full.requires_grad_(requires_grad)
            self.full_params.append(over_full)
        after_accumulation(self._gradient_arrived, [p for p in self.full_params if p.requires_grad])
        self.gradients_expected = sum(p.requires_grad for p in self.full_params)
        held = [length for _, length in self.spans]
        self._split_sizes = held + [piece - sum(held)]  # each parameter's span, then this piece's padding
        self._places_in_send = self.layout.offsets if self.layout else []
        self.full.untyped_storage().resize_(0)
        if self.layout is not None:
            # From here on the layout is geometry only (pieces, offsets): it
            # must not keep the original full parameters alive, or every rank
            # would hold the whole model once more (+4 bytes per parameter).
            self.layout.params = []

    def _take_rank0s_pieces(self) -> None:
        """Every rank's piece from rank 0's parameters, as MiniDDP starts from rank 0's weights.

        Otherwise a rank that initialized differently (a forgotten seed) would
        shard its own values, and the model would be a patchwork no rank had.
        One scatter per unit, once: each rank receives only its piece."""
        if self.layout is None or self.world_size == 1:
            return
        pieces = None
        if self.rank == 0:
            pieces = [self.layout.read(r, 0, self.layout.piece, lambda p: p) for r in range(self.world_size)]
        dist.scatter(self.shard, pieces, src=dist.get_global_rank(self.group, 0), group=self.group)

    # ------------------------------------------------------------ gather / free
    def start_gather(self) -> None:
        """Launch the all-gather of every rank's piece into ``full`` (a no-op unless sharded)."""
        if self.state is not UnitState.SHARDED:
            return
        for _, lender, _ in self.borrowed:
            lender.start_gather()
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        if self.layout is not None:
            self.gathers += 1
            send = self.shard.to(self.compute_dtype)
            if self.world_size > 1:
                self._gather_work = all_gather(self.full, send, group=self.group, async_op=True)
            else:
                self.full.copy_(send)
        self.state = UnitState.GATHERING

    def wait_gathered(self) -> None:
        """Gather (or finish the prefetch) and let the modules see the full parameters."""
        self.start_gather()
        for _, lender, _ in self.borrowed:
            lender.wait_gathered()
        if self.state is UnitState.GATHERING:
            if self._gather_work is not None:
                self._gather_work.wait()
                self._gather_work = None
            self.state = UnitState.GATHERED
        for full, places in zip(self.full_params, self.places):
            for module, name in places:
                module.__dict__[name] = full  # found before module._parameters by attribute lookup
        for (module, name), lender, index in self.borrowed:
            module.__dict__[name] = lender.full_params[index]

    def free(self, free_lenders: bool = True) -> None:
        """Back to the shard: drop the full storage; the modules see their shard parameters again."""
        if self.state is UnitState.GATHERING and self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
        for places in self.places:
            for module, name in places:
                module.__dict__.pop(name, None)
        for (module, name), lender, _ in self.borrowed:
            module.__dict__.pop(name, None)
            if free_lenders:
                lender.free()
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    # ------------------------------------------------------------ gradients
    def _gradient_arrived(self, _: torch.Tensor) -> None:
        self.gradients_in += 1
        if self.gradients_in == self.gradients_expected:
            self._on_gradient(self)

    def _send_buffer(self) -> torch.Tensor:
        """This step's send buffer, zeros (a gradient that never comes counts as zeros), taken once."""
        if self._send is None:
            self._send = self._lend_buffer(self)
        return self._send

    def gradients_into_send_buffer(self) -> None:
        """Before the unit's backward: each parameter's ``.grad`` becomes its place in the send buffer.

        Autograd then accumulates every gradient straight into it (as DDP's
        ``gradient_as_bucket_view`` does into a bucket): no full-size
        ``.grad`` beside the buffer, no copy, no Python per gradient. Only
        when gradients are reduced in their own dtype (else they are copied,
        and cast, at the launch).
        """
        if self.layout is None or self.reduce_dtype != self.compute_dtype:
            return
        send = self._send_buffer()
        for full, start in zip(self.full_params, self._places_in_send):
            if full.requires_grad:
                place = send[start: start + full.numel()].view(full.shape)
                if full.grad is not None and full.grad.data_ptr() != place.data_ptr():
                    place.copy_(full.grad)  # accumulated before (sync off, or a tied use elsewhere)
                full.grad = place

    def start_reduce_scatter(self) -> None:
        """Average the unit's gradients over the ranks (async); this rank keeps its piece."""
        if self.layout is None or self.pending is not None:
            return
        send = self._send_buffer()
        for full, start in zip(self.full_params, self._places_in_send):
            place = send[start: start + full.numel()]
            if full.grad is not None and full.grad.data_ptr() != place.data_ptr():
                place.copy_(full.grad.reshape(-1))  # a gradient that did not land in its place: copied (and cast)
            full.grad = None
        # One division by N for the whole unit, before the sum, as DDP divides (the same rounding as its).
        send.mul_(1.0 / self.world_size)
        self._send = None
        self.reduce_scatters += 1
        self.pending = start_reduce_scatter(send, self.layout.piece, self.rank, self.group, self.on_gloo)

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter; add the piece, in the master dtype, to the shards' ``.grad``."""
        if self.pending is None:
            return
        piece = self.pending.wait(self.master_dtype)
        self.pending = None
        # This rank's spans lie end to end from the piece's start: one split cuts them all.
        for shard_param, values in zip(self.shard_params, piece.split(self._split_sizes)):
            if not shard_param.requires_grad:
                continue
            if shard_param.grad is None:
                shard_param.grad = values
            else:
                shard_param.grad.add_(values)

    def has_gradients(self) -> bool:
        return any(full.grad is not None for full in self.full_params)


def _own_buffer(unit: ShardedUnit) -> torch.Tensor:
    return torch.zeros(unit.full.numel(), dtype=unit.reduce_dtype, device=unit.full.device)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
