"""Exercise 04: data parallelism by hand (lesson 04).

Write the two functions below; then, from the repository's root:

    python -m lessons.grade 04

The grader starts 3 ranks (then 2, 4 and 1), each with its *own* random weights, wraps the
lessons' bench model with your functions (``broadcast_parameters`` once,
``average_gradients`` after every backward), trains 3 SGD steps on each
rank's slice of a batch, and compares with one process training on the whole
batch; then again with one parameter frozen (its ``.grad`` stays ``None``).

It also trains a family of models (a frozen parameter, one without a gradient
in some steps, a weight shared by two layers) and a bfloat16 copy of one: each
gradient travels, and stays, in its own dtype.
"""

import torch.distributed as dist
from torch import nn


def broadcast_parameters(module: nn.Module) -> None:
    """Make every rank's parameters equal to rank 0's, in place.

    Called once, right after the model is built and before any training.
    """
    raise NotImplementedError


def average_gradients(module: nn.Module) -> None:
    """After ``loss.backward()``: make every parameter's ``.grad`` the average over all ranks.

    Each rank computed the gradient of the mean loss over its own slice. The
    average of those is the gradient of the mean loss over the whole batch.
    Parameters whose ``.grad`` is ``None`` (no gradient this step) are left alone.
    """
    raise NotImplementedError
