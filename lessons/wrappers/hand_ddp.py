"""Lesson 04's wrapper: broadcast the weights once, average the gradients after backward."""

import torch.distributed as dist
import torch.nn as nn


class HandDDP(nn.Module):
    """The smallest data-parallel wrapper: sync weights once, gradients by hand."""

    def __init__(self, module: nn.Module, broadcast: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False while accumulating micro-batches
        # Without the broadcast each rank would train its own model from its own
        # random start; averaging gradients of different models means nothing.
        for p in self.module.parameters():
            if broadcast:
                dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        # Called after backward, before optimizer.step().
        if not self.require_sync:
            return
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= self.world_size
