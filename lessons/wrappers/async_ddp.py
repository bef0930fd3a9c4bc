"""Lesson 06's wrapper: lesson 05's hook launches the all-reduce and goes on; the wait comes at the end."""

import torch
import torch.distributed as dist
import torch.nn as nn


class AsyncDDP(nn.Module):
    """Lesson 05's HookDDP, launching all_reduce without waiting for it."""

    def __init__(self, module: nn.Module, link=None, broadcast: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False while accumulating micro-batches
        self.link = link
        self.pending = []  # (param, future) launched during this backward
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

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        if self.link is not None:  # the same sum, at the simulated network's pace
            return self.link.all_reduce(tensor)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def _average_grad(self, param: torch.Tensor) -> None:
        if self.require_sync:
            self.pending.append((param, self._all_reduce(param.grad)))  # launch, and go on

    def finish_gradient_synchronization(self) -> None:
        # Called after backward, before optimizer.step().
        for param, future in self.pending:
            future.wait()
            param.grad /= self.world_size
        self.pending.clear()
