"""Exercise 04 with the sum, never divided."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "did you divide by the world size?"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
import torch.distributed as dist  # noqa: E402

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
