"""Exercise 04 broadcasting the weights from rank 1: the ranks agree, on the wrong start."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "every rank holds rank 1's starting weights"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
import torch.distributed as dist  # noqa: E402

average_gradients = right.average_gradients


def broadcast_parameters(module) -> None:
    for p in module.parameters():
        dist.broadcast(p.data, src=1)
