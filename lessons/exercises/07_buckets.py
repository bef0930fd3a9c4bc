"""Exercise 07: flat buckets, launched in order (lesson 07).

The buckets are built for you in ``__init__``. Write ``_on_gradient`` and
``finish``; then, from the repository's root:

    python -m lessons.grade 07

The grader trains two models through ``BucketAverager`` on 3 ranks (then 2, 4 and 1) and
compares with one process on the whole batch: the lessons' bench model, and
one whose ranks compute two branches in different orders, so that their
gradients (and full buckets) arrive in different orders on different ranks.
It counts the all-reduces of every step (one per bucket) and checks that the
first leaves while backward is still computing gradients (before the last
one is ready); as in exercise 06, a sum
reaches its tensor at ``wait()``, ``finish()`` must leave nothing held, and
nothing may be sent while ``require_sync`` is False.

It also trains a model with a frozen parameter and a weight shared by two
layers, and a bfloat16 copy of it: each gradient travels, and stays, in its
own dtype.
"""

import torch
import torch.distributed as dist
from torch import nn


class BucketAverager:
    """Averages gradients in flat buckets, each all-reduced as soon as it, and every bucket before it, is full."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: int):
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        # Reverse registration order: backward produces the last layer's gradients first.
        self.buckets, current, size = [], [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        self.buckets.append(current)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # gradients arrived so far, per bucket
        self.next_bucket = 0  # the next bucket to launch
        self.pending = []  # what has been launched and finish must wait for
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_gradient(self, param: torch.Tensor) -> None:
        """The hook: note that ``param.grad`` is ready; launch every bucket that may now leave.

        A bucket is all-reduced as one flat tensor (``torch.cat`` of its
        gradients), asynchronously. Collectives are matched by the order in
        which ranks call them, and gradients may arrive in a different order
        on different ranks: bucket i may leave only after buckets 0 .. i-1.
        Only when ``self.require_sync`` is True.
        """
        raise NotImplementedError

    def finish(self) -> None:
        """Called after backward: wait for every bucket, average it, copy it back into each ``.grad``; reset for the next step."""
        raise NotImplementedError
