"""This rank's averaged gradients in its shards, and what the current round has put there.

A *round* is the backwards between two steps. Whichever path brings the
averaged gradients writes them here: the optimizer's own reduce-scatter at
``step`` (no wrapper), stage 1's comm hook on MiniDDP
(:mod:`minddp.zero.stage1_hook`), stage 2's reduce-scatter of each bucket
(:mod:`minddp.zero.stage2`). The optimizer reads what arrived when it steps,
and :mod:`minddp.zero.presence` asks which parameters had a gradient.

The gradients themselves are the shards' ``master.grad``
(:meth:`minddp.zero.shards.Shard.gradient`); this object keeps the round's
bookkeeping beside them, so that the paths that fill the shards call its
methods instead of the optimizer's internals.
"""

from __future__ import annotations

import torch

from minddp.zero.shards import Shard, ShardLayout

__all__ = ["ShardedGradients"]


class ShardedGradients:
    """The round's gradients in ``layout``'s shards (the optimizer sets ``layout`` anew when it repartitions)."""

    def __init__(self, layout: ShardLayout | None = None):
        self.layout = layout
        self.in_shards = False  # this round's averaged gradients are in the shards
        self.from_hook = False  # and came through a comm hook of MiniDDP's (not from .grad)
        self.used: set[int] = set()  # stage 2: ids of the parameters the reducer saw a gradient for
        self.written_units: set[int] = set()  # stage 2: units whose piece is in the shards this round

    def begin_round(self) -> None:
        """A bucket's gradients arrive: the first of a round zeroes every shard gradient (the other buckets' parts)."""
        if not self.in_shards:
            for shard in self.layout.shards:
                shard.gradient().zero_()
            self.in_shards = True
            self.from_hook = True

    def fill_param(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """This rank's elements of one parameter's (averaged) gradient into the shards, replacing what is there."""
        self.layout.fill_param(param, grad, Shard.gradient)

    def receive_piece(self, unit_index: int, piece: torch.Tensor) -> None:
        """Stage 2: a bucket's reduce-scattered piece, into the shards (summed over backwards)."""
        self.begin_round()
        self.layout.take_piece(unit_index, piece, Shard.gradient, accumulate=True)

    def end_round(self) -> None:
        """A step consumed the shards' gradients: the next backward allocates them again (1/N of the grads)."""
        self.in_shards = self.from_hook = False
        self.used = set()
        self.written_units = set()
        for shard in self.layout.shards:
            shard.detach_gradients()
