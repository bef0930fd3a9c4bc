"""Who owns which elements: partitions of flat buffers over the ranks.

ZeRO's unit of work is a *flat buffer*: a few parameters laid end to end, as
if concatenated (a :class:`FlatUnit`; nothing is allocated, it only knows the
offsets). Each rank owns one contiguous range of every unit. Two ways to cut:

* ``"flat"`` (the ZeRO paper, DeepSpeed): pad the unit to a multiple of N
  and cut it into N equal pieces. A tensor may span two ranks; the pieces
  differ by at most the padding, whatever the tensor sizes::

      unit  |  wte (most of it)        |ln|fc |pad|
      ranks |  rank 0    |  rank 1     |  rank 2   |

* ``"greedy"`` (torch's ``ZeroRedundancyOptimizer``): whole tensors, largest
  first, each to the rank with the fewest elements so far. No tensor is ever
  split, so one large embedding can leave one rank holding most of the
  optimizer state (and the all-gather pads every piece to the largest).

A rank's elements of a unit are a list of :class:`Segment` s, each inside one
parameter; the optimizer's shard is those segments laid end to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Segment", "FlatUnit", "flat_units", "greedy_units", "PARTITIONS"]

PARTITIONS = ("flat", "greedy")


@dataclass(frozen=True, eq=False)  # compared by identity: it holds a tensor
class Segment:
    """Elements ``[param_start, param_start + length)`` of ``param`` (flattened),
    at ``unit_start`` in its unit's flat space."""

    param: torch.Tensor
    param_start: int
    unit_start: int
    length: int


class FlatUnit:
    """Parameters laid end to end, and the contiguous range each rank owns.

    ``ranges[r] = (start, end)`` in the unit's flat space; ``piece`` is the
    length every rank sends in a collective (the longest range; shorter ones
    are padded with zeros).
    """

    def __init__(self, params: list[torch.Tensor], ranges: list[tuple[int, int]] | int):
        """``ranges``: each rank's ``(start, end)``, or a world size for N equal (padded) pieces."""
        self.params = params
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.ranges = equal_ranges(self.numel, ranges) if isinstance(ranges, int) else ranges
        self.piece = max(end - start for start, end in self.ranges)
        self.dtype = params[0].dtype
        self.device = params[0].device

    def segments(self, rank: int) -> list[Segment]:
        """The parts of each parameter that fall in ``rank``'s range, in unit order."""
        return self._overlapping(*self.ranges[rank])

    def read(self, rank: int, lo: int, hi: int, source) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``rank``'s piece, taken from ``source(param)``
        (a tensor shaped like the parameter, or None for zeros); zero padded."""
        out = torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
        start, end = self.ranges[rank]
        for seg in self._overlapping(start + lo, min(start + hi, end)):
            values = source(seg.param)
            if values is not None:
                out[seg.unit_start - start - lo: seg.unit_start - start - lo + seg.length] = \
                    values.reshape(-1)[seg.param_start: seg.param_start + seg.length]
        return out

    def write(self, rank: int, lo: int, values: torch.Tensor, dest) -> None:
        """Put ``values``, elements ``[lo, lo + len)`` of ``rank``'s piece, into
        ``dest(param)`` (a tensor shaped like the parameter; padding dropped)."""
        start, end = self.ranges[rank]
        for seg in self._overlapping(start + lo, min(start + lo + values.numel(), end)):
            target = dest(seg.param)
            if target is not None:
                at = seg.unit_start - start - lo
                target.view(-1)[seg.param_start: seg.param_start + seg.length].copy_(values[at: at + seg.length])

    def _overlapping(self, lo: int, hi: int) -> list[Segment]:
        found = []
        for p, offset in zip(self.params, self.offsets):
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                found.append(Segment(p, a - offset, a, b - a))
        return found


def equal_ranges(numel: int, world_size: int) -> list[tuple[int, int]]:
    """N equal pieces of ``numel`` padded up to a multiple of N (the last ones end early)."""
    piece = -(-numel // world_size)
    return [(min(r * piece, numel), min((r + 1) * piece, numel)) for r in range(world_size)]


def flat_units(params: list[torch.Tensor], world_size: int) -> list[FlatUnit]:
    """One unit per dtype and device, in first-appearance order, cut into N equal pieces."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    return [FlatUnit(group, world_size) for group in by_kind.values()]


def greedy_units(params: list[torch.Tensor], world_size: int, totals: list[int]) -> list[FlatUnit]:
    """torch's assignment: largest tensor first, to the rank with the fewest elements.

    ``totals`` (elements per rank so far) is updated in place, so that groups
    partitioned one after the other balance together, as torch does.
    """
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    units = []
    for group in by_kind.values():
        owned: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for p in sorted(group, key=lambda t: t.numel(), reverse=True):  # stable: ties keep order
            rank = min(range(world_size), key=lambda r: totals[r])
            owned[rank].append(p)
            totals[rank] += p.numel()
        ordered = [p for mine in owned for p in mine]  # rank 0's tensors first, then rank 1's...
        ranges, start = [], 0
        for mine in owned:
            end = start + sum(p.numel() for p in mine)
            ranges.append((start, end))
            start = end
        units.append(FlatUnit(ordered, ranges))
    return units
