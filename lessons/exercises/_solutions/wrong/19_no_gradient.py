"""Exercise 19 that never gives the shard its gradient: the optimizer skips it."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "the parameters did not move"
right = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class ShardedOptimizer(right.ShardedOptimizer):
    def step(self) -> None:
        self.optimizer.step()  # self.shard.grad is None: nothing happens
        everyone = torch.empty(self.piece * self.world_size)
        dist.all_gather(list(everyone.chunk(self.world_size)), self.shard.detach())
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(everyone[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
