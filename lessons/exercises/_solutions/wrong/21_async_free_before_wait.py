"""Exercise 21 that launches the reduce-scatter with async_op=True, frees the full gradient and divides the shard
before wait(), racing the collective."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

EXPECT = 'before waiting for it'
reference = load(Path(__file__).resolve().parent.parent / "21_fsdp_unit.py")
free, reduce_scatter = reference.free, reference.reduce_scatter


class GatherComputeFree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, unit) -> torch.Tensor:
        ctx.unit = unit
        ctx.save_for_backward(x)
        full = unit.gather()
        out = unit.run(full, x)
        free(full)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,), unit = ctx.saved_tensors, ctx.unit
        full = unit.gather().requires_grad_()
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            grad_x, grad_full = torch.autograd.grad(unit.run(full, x), (x, full), grad_out)
        grad_shard = torch.empty_like(unit.shard)
        work = reduce_scatter(grad_shard, grad_full, async_op=True)
        free(full)
        free(grad_full)
        grad_shard = grad_shard / unit.world_size
        work.wait()
        return grad_x, grad_shard, None


class Sharded(reference.Sharded):
    def forward(self, x):
        for unit in self.units:
            x = GatherComputeFree.apply(x, unit.shard, unit)
        return x
