"""Exercise 04 averaging every parameter's .grad without asking whether it has one: a frozen parameter's
.grad is None, and all_reduce(None) raises."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "whose .grad is None"

right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")

import torch.distributed as dist  # noqa: E402

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    for p in module.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
