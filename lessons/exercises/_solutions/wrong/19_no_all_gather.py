"""Exercise 19 that steps its piece and copies back only that piece: the ranks drift apart."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "all-gather every rank's updated piece"
right = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")
import torch  # noqa: E402


class ShardedOptimizer(right.ShardedOptimizer):
    def step(self) -> None:
        self.shard.grad = self.my_piece(torch.cat([p.grad.reshape(-1) for p in self.params])).clone()
        self.optimizer.step()
        start, offset = self.rank * self.piece, 0
        with torch.no_grad():
            for p in self.params:  # write back this rank's elements only
                flat = p.view(-1)
                lo, hi = max(start, offset), min(start + self.piece, offset + p.numel())
                if lo < hi:
                    flat[lo - offset:hi - offset] = self.shard[lo - start:hi - start]
                offset += p.numel()
