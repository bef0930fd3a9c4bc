"""This rank's shards: the elements it owns, laid end to end per parameter group.

The partition (:mod:`minddp.zero.partition`) says which elements of each flat
unit a rank owns. The local optimizer wants something simpler: one flat tensor
per parameter group (and dtype) to step, with its gradient. A :class:`Shard`
is that tensor; :class:`ShardLayout` knows where each of its elements comes
from (a :class:`~minddp.zero.partition.Segment` of a parameter) and where it
goes back to, in both directions:

* parameters or gradients (shaped like the parameters) -> shards: :meth:`ShardLayout.fill`;
* a shard-shaped tensor -> this rank's piece of a unit, for a collective:
  :meth:`ShardLayout.piece`, and back: :meth:`ShardLayout.take_piece`.
"""

from __future__ import annotations

from typing import Callable

import torch

from minddp.zero.partition import FlatUnit, Segment

__all__ = ["Shard", "ShardLayout"]


class Shard:
    """This rank's elements of parameter group ``group`` (one dtype), end to end.

    ``master`` holds the elements, end to end (what collectives and
    checkpoints read); ``master.grad`` their averaged gradient (``None`` until
    one arrives). The local optimizer does not step ``master`` whole: it steps
    ``views``, one view of ``master`` per segment, so each parameter's part
    is a parameter of its own there. Why: torch's optimizers decide *per
    parameter* whether to step (a ``None`` gradient: not stepped, Adam's
    ``step`` count not advanced), and a parameter frozen or unused for a step
    must keep its own count, as under ``torch.optim`` and torch's ZeRO.
    May be empty: a rank can own nothing of a small group, and still keeps
    the (empty) shard so that every rank's local optimizer has the same groups.
    """

    def __init__(self, group: int, dtype: torch.dtype, device: torch.device):
        self.group = group
        self.segments: list[Segment] = []
        self.offsets: list[int] = []
        self.numel = 0
        self.master = torch.empty(0, dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []

    def set_master(self, master: torch.Tensor) -> None:
        """Take ``master`` as this shard's elements; ``views`` become its segments' views."""
        self.master = master
        self.views = [master[offset: offset + seg.length] for seg, offset in zip(self.segments, self.offsets)]

    def gradient(self) -> torch.Tensor:
        """``master.grad``, this shard's averaged gradient: zeros made at its first use."""
        if self.master.grad is None:
            self.master.grad = torch.zeros_like(self.master)
        return self.master.grad

    def attach_gradients(self, stepped: set[int]) -> None:
        """Each view's ``.grad``: its part of ``master.grad``, or None if its parameter is not stepped."""
        grad = self.master.grad
        for seg, offset, view in zip(self.segments, self.offsets, self.views):
            view.grad = grad[offset: offset + seg.length] if grad is not None and id(seg.param) in stepped else None

    def detach_gradients(self) -> None:
        self.master.grad = None
        for view in self.views:
            view.grad = None

    def add(self, segment: Segment) -> int:
        self.segments.append(segment)
        self.offsets.append(self.numel)
        self.numel += segment.length
        return self.offsets[-1]


class ShardLayout:
    """The shards of ``rank`` for a list of units, and the maps between them.

    ``group_of`` gives each parameter's group index (a unit may hold several
    groups' parameters: stage 2's units are MiniDDP's buckets).
    """

    def __init__(self, units: list[FlatUnit], group_of: dict[int, int], rank: int, world_size: int):
        self.units, self.group_of, self.rank, self.world_size = units, group_of, rank, world_size
        self.shards: list[Shard] = []
        keys: dict[tuple[int, torch.dtype], Shard] = {}
        # Every (group, dtype) any rank holds gets a shard here, even an empty one.
        kinds = {(group_of[id(p)], p.dtype) for u in units for p in u.params}
        for key in sorted(kinds, key=lambda k: (k[0], str(k[1]))):
            keys[key] = Shard(key[0], key[1], units[0].device)
            self.shards.append(keys[key])
        # unit index -> this rank's segments of it, each with its shard and offset there.
        self.unit_segments: list[list[tuple[Segment, Shard, int]]] = []
        self.param_segments: dict[int, list[tuple[Segment, Shard, int]]] = {}  # by id(param)
        for unit in units:
            mine = []
            for seg in unit.segments(rank):
                shard = keys[(group_of[id(seg.param)], seg.param.dtype)]
                mine.append((seg, shard, shard.add(seg)))
                self.param_segments.setdefault(id(seg.param), []).append(mine[-1])
            self.unit_segments.append(mine)
        for shard in self.shards:
            shard.set_master(torch.empty(shard.numel, dtype=shard.master.dtype, device=shard.master.device))

    @property
    def params(self) -> list[torch.Tensor]:
        """Every parameter of every unit (whoever owns it), once, in unit order."""
        return list({id(p): p for u in self.units for p in u.params}.values())

    def shards_of_group(self, group: int) -> list[Shard]:
        return [s for s in self.shards if s.group == group]

    def fill(self, shard_tensor: Callable[[Shard], torch.Tensor], source: Callable[[torch.Tensor], torch.Tensor | None],
             accumulate: bool = False) -> None:
        """Copy (or add) this rank's elements of ``source(param)`` into ``shard_tensor(shard)``;
        a ``None`` source counts as zeros."""
        for shard in self.shards:
            target = shard_tensor(shard)
            for seg, offset in zip(shard.segments, shard.offsets):
                values = source(seg.param)
                part = target[offset: offset + seg.length]
                if values is None:
                    if not accumulate:
                        part.zero_()
                    continue
                values = values.reshape(-1)[seg.param_start: seg.param_start + seg.length]
                part.add_(values) if accumulate else part.copy_(values)

    def fill_param(self, param: torch.Tensor, values: torch.Tensor,
                   shard_tensor: Callable[[Shard], torch.Tensor]) -> None:
        """Copy this rank's elements of one parameter's ``values`` (shaped like it) into the shards."""
        flat = values.reshape(-1)
        for seg, shard, offset in self.param_segments.get(id(param), ()):
            shard_tensor(shard)[offset: offset + seg.length].copy_(flat[seg.param_start: seg.param_start + seg.length])

    def piece(self, unit_index: int, shard_tensor: Callable[[Shard], torch.Tensor]) -> torch.Tensor:
        """This rank's piece of a unit (zero padded to ``unit.piece``), read from shard-shaped tensors."""
        unit = self.units[unit_index]
        start = unit.ranges[self.rank][0]
        out = torch.zeros(unit.piece, dtype=unit.dtype, device=unit.device)
        for seg, shard, offset in self.unit_segments[unit_index]:
            at = seg.unit_start - start
            out[at: at + seg.length] = shard_tensor(shard)[offset: offset + seg.length]
        return out

    def take_piece(self, unit_index: int, piece: torch.Tensor, shard_tensor: Callable[[Shard], torch.Tensor],
                   accumulate: bool = False) -> None:
        """The reverse of :meth:`piece`: this rank's piece of a unit into shard-shaped tensors."""
        start = self.units[unit_index].ranges[self.rank][0]
        for seg, shard, offset in self.unit_segments[unit_index]:
            values = piece[seg.unit_start - start: seg.unit_start - start + seg.length]
            part = shard_tensor(shard)[offset: offset + seg.length]
            part.add_(values) if accumulate else part.copy_(values)
