"""Exercise 05, solved."""

import torch
import torch.distributed as dist
from torch import nn


class HookAverager:
    def __init__(self, module: nn.Module):
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True
        self.register_hooks()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def register_hooks(self) -> None:
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: torch.Tensor) -> None:
        # param.grad already holds this pass's gradient added to the earlier micro-batches'.
        if self.require_sync:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= self.world_size
