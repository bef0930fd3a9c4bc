"""Uneven inputs: letting ranks that ran out of data finish without hanging the rest.

Every synchronized step issues the same collectives on every rank. If rank 1
has 3 batches and rank 0 has 5, rank 0's fourth backward waits forever for a
partner. Dropping data to make shards even throws samples away; ``join``
keeps them:

    with model.join():
        for batch in my_batches:          # a different count per rank
            loss_fn(model(batch)).backward()
            optimizer.step()

A rank that leaves its loop *shadows* the others: for every step they still
take, it issues the same collectives with zeros (the join check, the buffer
broadcast, one all-reduce per bucket), so their all-reduces complete and a
finished rank contributes nothing. Every synchronized forward starts with one
small all-reduce, a 0/1 flag per rank, that tells everyone who is still
active; when no one is, the loop ends and the last active rank's parameters
are broadcast to all, so the replicas leave ``join`` identical.

Gradients are divided by the *initial* world size by default, as in torch's
DDP: a step where one of four ranks has joined is a step on 3/4 of a batch.
``divide_by_initial_world_size=False`` divides by the number of active ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minddp.sync import broadcast_coalesced

if TYPE_CHECKING:
    from minddp.ddp import MiniDDP

__all__ = ["Join"]


class Join:
    """The context manager returned by :meth:`MiniDDP.join`; one per ``with`` block."""

    def __init__(self, ddp: "MiniDDP", divide_by_initial_world_size: bool = True):
        if ddp.buffer_sync == "average":
            raise ValueError(
                "join() needs buffer_sync='broadcast' or 'off': a rank that has run out of data "
                "would pull the averaged buffers towards its stale ones"
            )
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.last_active = 0  # group rank whose replica is authoritative

    def __enter__(self) -> "Join":
        self.ddp._join = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._shadow_until_everyone_joined()
        finally:
            self.ddp._join = None
            self.ddp._divisor = self.ddp.world_size

    def exchange(self, active: bool) -> list[bool]:
        """The per-step collective: which ranks are still training."""
        ddp = self.ddp
        flags = torch.zeros(ddp.world_size, dtype=torch.int32, device=ddp.device)
        flags[dist.get_rank(ddp.process_group)] = int(active)
        dist.all_reduce(flags, group=ddp.process_group)
        who = [bool(f) for f in flags.tolist()]
        if any(who):
            self.last_active = max(r for r, a in enumerate(who) if a)
            n = len(who) if self.divide_by_initial_world_size else sum(who)
            ddp._divisor = n
        return who

    def _shadow_until_everyone_joined(self) -> None:
        ddp = self.ddp
        while any(self.exchange(active=False)):
            ddp._shadow_synchronized_step(buffer_source=self.last_active)
        # Everyone is done: the last rank to train has the newest parameters.
        broadcast_coalesced(list(ddp.module.parameters()) + ddp._buffers_to_sync, ddp.process_group, self.last_active)
