"""Exercise 04 that gives a frozen parameter (``.grad`` None) a gradient of zeros before averaging: the numbers
agree, but a frozen parameter's ``.grad`` must stay None (an optimizer with momentum or weight decay moves a
parameter whose ``.grad`` is zeros; it skips one whose ``.grad`` is None)."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

EXPECT = "must stay None"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
