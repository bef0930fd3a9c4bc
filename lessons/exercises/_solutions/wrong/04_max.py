"""Exercise 04 reducing with ReduceOp.MAX: the ranks agree, on the wrong gradient."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "op=ReduceOp.MAX"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
import torch.distributed as dist  # noqa: E402

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)
