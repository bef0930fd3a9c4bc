"""Exercise 04 broadcasting the weights but not the biases: the biases start different on every rank."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "0.bias, 2.bias, 4.bias differ from rank 0's"
right = load(Path(__file__).resolve().parent.parent / "04_average_gradients.py")
import torch.distributed as dist  # noqa: E402

average_gradients = right.average_gradients


def broadcast_parameters(module) -> None:
    for name, p in module.named_parameters():
        if name.endswith("weight"):
            dist.broadcast(p.data, src=0)
