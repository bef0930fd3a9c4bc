"""Exercise 19 getting this rank's piece of the gradient as ZeRO does, by a reduce-scatter of the flat
gradients (a sum over the ranks: divided by the world size, since every p.grad is already the average)."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

reference = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")


class ShardedOptimizer(reference.ShardedOptimizer):
    def step(self) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        padded = torch.nn.functional.pad(flat, (0, self.piece * self.world_size - self.numel))
        piece = torch.empty(self.piece)
        dist.reduce_scatter_tensor(piece, padded)
        self.shard.grad = piece / self.world_size
        self.optimizer.step()
        everyone = torch.empty(self.piece * self.world_size)
        dist.all_gather_into_tensor(everyone, self.shard.detach())
        with torch.no_grad():
            for p, new in zip(self.params, everyone[:self.numel].split([p.numel() for p in self.params])):
                p.copy_(new.view_as(p))
