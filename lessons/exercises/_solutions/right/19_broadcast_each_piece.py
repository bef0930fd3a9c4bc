"""Exercise 19 bringing the pieces to every rank with one broadcast per piece, from the rank that owns it:
another algorithm with an all-gather's bytes (each piece travels from its owner once)."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

reference = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")


class ShardedOptimizer(reference.ShardedOptimizer):
    def step(self) -> None:
        self.shard.grad = self.my_piece(torch.cat([p.grad.reshape(-1) for p in self.params])).clone()
        self.optimizer.step()
        line = torch.empty(self.piece * self.world_size)
        for owner, piece in enumerate(line.split(self.piece)):
            if owner == self.rank:
                piece.copy_(self.shard.detach())
            dist.broadcast(piece, src=owner)
        with torch.no_grad():
            for p, new in zip(self.params, line[:self.numel].split([p.numel() for p in self.params])):
                p.copy_(new.view_as(p))
