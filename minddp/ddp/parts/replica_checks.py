"""``check_sync_every=N``: every N-th synchronized forward, verify that all replicas are identical.

A forward-time part of ``MiniDDP``: one small collective of checksums
(:func:`minddp.ddp.replicas.check_replicas_in_sync`), raising on every rank and
naming the first tensor that differs. Skipped inside ``join()`` while some
rank has stopped training (its replica is allowed to lag until the join ends).
"""

from __future__ import annotations

from torch import nn
import torch.distributed as dist

from minddp.ddp.replicas import check_replicas_in_sync

__all__ = ["ReplicaChecks"]


class ReplicaChecks:
    def __init__(self, module: nn.Module, group: dist.ProcessGroup, every: int):
        self.module, self.group, self.every = module, group, every
        self.synchronized_forwards = 0

    def before_forward(self, everyone_trains: bool) -> None:
        """Before a synchronized forward; ``everyone_trains``: False inside ``join()`` once a rank has stopped."""
        if self.synchronized_forwards % self.every == 0 and everyone_trains:
            check_replicas_in_sync(self.module, self.group)
        self.synchronized_forwards += 1
