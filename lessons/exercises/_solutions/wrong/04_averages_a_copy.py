"""Exercise 04 averaging each gradient into a copy that nobody reads."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "never averaged"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
import torch.distributed as dist  # noqa: E402

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            grad = p.grad.clone()  # the average lands in a copy; .grad keeps this rank's own
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
