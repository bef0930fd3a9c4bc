"""Exercise 19 gathering the pieces into the wrong places: the list handed to all_gather is reversed."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "rank order"
right = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class ShardedOptimizer(right.ShardedOptimizer):
    def step(self) -> None:
        self.shard.grad = self.my_piece(torch.cat([p.grad.reshape(-1) for p in self.params])).clone()
        self.optimizer.step()
        everyone = torch.empty(self.piece * self.world_size)
        dist.all_gather(list(everyone.chunk(self.world_size))[::-1], self.shard.detach())  # rank r's piece lands at p-1-r
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(everyone[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
