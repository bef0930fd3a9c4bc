"""Lesson 05's wrapper: lesson 04's averaging, moved into backward by a hook per parameter."""

import torch
import torch.distributed as dist
import torch.nn as nn


class HookDDP(nn.Module):
    """Lesson 04's HandDDP, with the averaging moved into backward."""

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
            if p.requires_grad:
                self._add_hook(p)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _add_hook(self, p: torch.Tensor) -> None:
        p.register_post_accumulate_grad_hook(self._average_grad)

    def _average_grad(self, param: torch.Tensor) -> None:
        # By now param.grad holds everything accumulated so far, this pass
        # included, so averaging it once at the end averages all of it.
        if self.require_sync:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= self.world_size
