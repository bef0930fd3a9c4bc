"""Exercise 19 gathering the pieces with one flat all_gather_into_tensor, writing back through views."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

reference = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")


class ShardedOptimizer(reference.ShardedOptimizer):
    def step(self) -> None:
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.shard.grad = self.my_piece(grads).clone()
        self.optimizer.step()
        everyone = torch.empty(self.piece * self.world_size)
        dist.all_gather_into_tensor(everyone, self.shard.detach())
        with torch.no_grad():
            for p, new in zip(self.params, everyone[:self.numel].split([p.numel() for p in self.params])):
                p.copy_(new.view_as(p))
