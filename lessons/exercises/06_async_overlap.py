"""Exercise 06: launch the all-reduces from the hooks, wait for them at the end (lesson 06).

Write ``_launch`` and ``finish`` below; then, from the repository's root:

    python -m lessons.grade 06

The grader trains the lessons' bench model through ``AsyncAverager`` on 3
ranks and compares with one process on the whole batch. It watches every
``dist.all_reduce`` call: each must be launched during backward, as soon
as its gradient is ready, without waiting there, and waited for in
``finish()``, which the grader calls after
every backward (before the optimizer step). Its all-reduce delivers the sum
into your tensor when you call ``wait()`` and not before (a real one may
still be running until then), so reading or dividing a gradient before its
``wait()`` is caught every time; and after ``finish()`` your code must hold
no handle any more (one kept per step is memory and work that grow). It
also checks that nothing is sent while ``require_sync`` is False.

It also trains a family of models (a frozen parameter, one without a gradient
in some steps, a weight shared by two layers) and a bfloat16 copy of one: each
gradient travels, and stays, in its own dtype.
"""

import torch
import torch.distributed as dist
from torch import nn


class AsyncAverager:
    """Lesson 05's hooks, with the all-reduce launched asynchronously so it travels while backward goes on."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True
        self.pending = []  # what _launch started and finish must wait for
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._launch)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _launch(self, param: torch.Tensor) -> None:
        """The hook: start summing ``param.grad`` over the ranks, and return at once.

        Only when ``self.require_sync`` is True. Do not wait here: backward
        must go on computing earlier layers' gradients while the sum travels.
        """
        raise NotImplementedError

    def finish(self) -> None:
        """Called after backward: wait for every sum launched (each handle has ``wait()``), and turn each into an average."""
        raise NotImplementedError
