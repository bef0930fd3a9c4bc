"""Exercise 19 bringing the updated pieces to every rank with an all-reduce of the whole line, zeros outside
this rank's piece: the right parameters, for twice the bytes an all-gather of the pieces moves."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "all-reduce of the whole line"
right = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class ShardedOptimizer(right.ShardedOptimizer):
    def step(self) -> None:
        self.shard.grad = self.my_piece(torch.cat([p.grad.reshape(-1) for p in self.params])).clone()
        self.optimizer.step()
        line = torch.zeros(self.piece * self.world_size)
        line[self.rank * self.piece:(self.rank + 1) * self.piece] = self.shard.detach()
        dist.all_reduce(line)  # every other rank adds zeros here, and its own piece elsewhere
        with torch.no_grad():
            for p, new in zip(self.params, line[:self.numel].split([p.numel() for p in self.params])):
                p.copy_(new.view_as(p))
