"""Exercise 04 averaging the weights' gradients and forgetting the biases'."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "the gradients of 0.bias, 2.bias, 4.bias are each rank's own"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
import torch.distributed as dist  # noqa: E402

broadcast_parameters = right.broadcast_parameters


def average_gradients(module) -> None:
    for name, p in module.named_parameters():
        if name.endswith("weight") and p.grad is not None:  # the biases are left out
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
