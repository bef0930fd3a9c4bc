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
dtype) and go at once, divided by N, into the unit's send buffer (made at its
first gradient); :meth:`start_reduce_scatter` sums that buffer over the
ranks into this rank's piece, and :meth:`finish_reduce_scatter` hands the
piece, in fp32, to the shard parameters' ``.grad``.

Life cycle: ``SHARDED -> (start_gather) GATHERING -> (wait_gathered) GATHERED
-> (free) SHARDED``; a reduce-scatter runs beside it (``pending``).
"""

from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from minddp.fsdp.collectives import PendingReduceScatter, gloo_collectives, start_all_gather, start_reduce_scatter
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
                 make_room: Callable[["ShardedUnit"], None] = lambda unit: None):
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
        self._make_room = make_room  # called before a send buffer is made: the previous one may go first
        self._send: torch.Tensor | None = None  # this step's gradients, scaled, end to end (reduce dtype)
        self._sent: list[bool] = []  # per parameter: its gradient is in ``_send``
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
            if requires_grad:
                over_full.register_post_accumulate_grad_hook(self._gradient_hook(len(self.full_params)))
            self.full_params.append(over_full)
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
                self._gather_work = start_all_gather(self.full, send, self.group, as_broadcasts=self.on_gloo)
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
    def _gradient_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def arrived(full: torch.Tensor) -> None:
            # Into the send buffer at once, and the full-size .grad let go: a
            # unit holds its buffer and one gradient, not all its gradients
            # twice. Not the root's: its gradients come around the other
            # units' (a final norm first, an embedding last), and a buffer
            # filled from the first would stay through the whole backward.
            if self.requires_gradient_sync and self.layout is not None and not self.is_root:
                self._into_send_buffer(index, full.grad)
                full.grad = None
            self.gradients_in += 1
            if self.gradients_in == self.gradients_expected:
                self._on_gradient(self)
        return arrived

    def _place_in_send_buffer(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s place in this step's send buffer (made at the first gradient of the step)."""
        if self._send is None:
            self._make_room(self)
            self._send = torch.empty(self.full.numel(), dtype=self.reduce_dtype, device=self.full.device)
            self._send[self.layout.numel:].zero_()  # the padding of the last piece
            self._sent = [False] * len(self.full_params)
        start = self._places_in_send[index]
        return self._send[start: start + self.full_params[index].numel()]

    def _into_send_buffer(self, index: int, grad: torch.Tensor) -> None:
        """One full-size gradient, divided by N, into its place: before the sum, as DDP divides (the
        same rounding as its), in the reduce dtype. A second one in the same step (a nested backward
        pass) adds to it."""
        place, grad = self._place_in_send_buffer(index), grad.reshape(-1)
        if self._sent[index]:
            place.add_(grad.to(self.reduce_dtype).mul_(1.0 / self.world_size))
        elif grad.dtype == place.dtype:
            torch.mul(grad, 1.0 / self.world_size, out=place)
        else:
            place.copy_(grad).mul_(1.0 / self.world_size)
        self._sent[index] = True

    def start_reduce_scatter(self) -> None:
        """Average the unit's gradients over the ranks (async); this rank keeps its piece."""
        if self.layout is None or self.pending is not None:
            return
        for index, full in enumerate(self.full_params):
            if full.grad is not None:  # accumulated while sync was off, and not hooked since
                self._into_send_buffer(index, full.grad)
                full.grad = None
            elif self._send is None or not self._sent[index]:  # no gradient on this rank: zeros
                self._place_in_send_buffer(index).zero_()
        send, self._send = self._send, None
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
        """Did a gradient arrive this step (in the send buffer), or is one held from an earlier backward?"""
        return self._send is not None or any(full.grad is not None for full in self.full_params)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
