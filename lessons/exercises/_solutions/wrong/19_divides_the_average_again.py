"""Exercise 19 dividing the gradients by the world size, though every p.grad is already the average."""

from pathlib import Path

import torch

from lessons.grading.runner import load

EXPECT = "do not divide it again"

right = load(Path(__file__).resolve().parent.parent / "19_zero1_step.py")


class ShardedOptimizer(right.ShardedOptimizer):
    def step(self) -> None:
        for p in self.params:
            p.grad /= self.world_size  # averaged once more
        super().step()
