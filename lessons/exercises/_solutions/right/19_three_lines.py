"""Exercise 19, another way: three full lines alive at once (the gradients end to end, padded, the gathered
line): what the docstring allows."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

reference = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")


class ShardedOptimizer(reference.ShardedOptimizer):
    def step(self) -> None:
        flat_grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        padded = torch.nn.functional.pad(flat_grad, (0, self.piece * self.world_size - self.numel))
        self.shard.grad = padded[self.rank * self.piece:(self.rank + 1) * self.piece].clone()
        self.optimizer.step()
        everyone = torch.empty(self.piece * self.world_size)
        dist.all_gather_into_tensor(everyone, self.shard.detach())

        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(everyone[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
