"""Exercise 04 sending rank 0's gradients to everyone instead of averaging every rank's."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "rank 0's own gradient on every rank"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
import torch.distributed as dist  # noqa: E402

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            dist.broadcast(p.grad, src=0)  # the same on every rank, but only rank 0's slice
