"""Exercise 06, solved."""

import torch
import torch.distributed as dist
from torch import nn


class AsyncAverager:
    def __init__(self, module: nn.Module):
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True
        self.pending = []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._launch)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _launch(self, param: torch.Tensor) -> None:
        if self.require_sync:
            self.pending.append((param, dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True)))

    def finish(self) -> None:
        for param, work in self.pending:
            work.wait()
            param.grad /= self.world_size
        self.pending.clear()
