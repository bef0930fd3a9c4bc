"""Lesson 07c, step 2: the library's buckets.

Step 1's hand-made buffers become :class:`minddp.ddp.core.buckets.Bucket`
objects: a flat buffer, a slot per gradient laid out in memory like its
parameter, a count of the gradients still to come, and a life cycle that
refuses misuse (a gradient counted twice, a launch before the last one).
Read ``minddp/ddp/core/buckets.py`` with this file.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minddp.ddp.core.assignment import MiB, TensorSpec, bucket_groups, first_guess_limits
from minddp.ddp.core.buckets import Bucket, BucketStorage
from minddp.ddp.core.reducer import ReducerOptions

_engine = torch.autograd.Variable._execution_engine


class BucketedReducer:
    """Step 1's reducer, with the library's buckets."""

    def __init__(self, params: list[nn.Parameter], names: list[str], process_group: dist.ProcessGroup,
                 options: ReducerOptions):
        self.params, self.names, self.options = params, names, options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.factor = 1 / self.world_size  # 2. what each gradient is multiplied by before the sum
        self.armed = False  # did a synchronized forward arm the next backward?
        self.backward_running = False
        self.storage = BucketStorage()
        self.device = params[0].device
        self.caps = (int(options.bucket_cap_mb * MiB), int(options.first_bucket_cap_mb * MiB))
        self.per_bucket_caps = [int(cap * MiB) for cap in options.bucket_caps_mb or ()]  # [] unless given
        self.first_guess_limits = first_guess_limits(self.caps, self.per_bucket_caps, options)
        for index, p in enumerate(params):
            p.register_post_accumulate_grad_hook(functools.partial(self._average_grad, index))
        # Reversed: backward produces the last layer's gradients first, so
        # the first bucket fills (and can leave) first.
        self._build_buckets(list(reversed(range(len(params)))))

    def _build_buckets(self, order: list[int] | None) -> None:
        """Build the buckets for parameter indices in expected-arrival ``order``, by ``caps``; ``None``:
        torch's first guess, before a backward has shown the order (:mod:`minddp.ddp.core.assignment`)."""
        dtypes = [self.options.reduce_dtype or p.dtype for p in self.params]  # what each gradient is reduced in
        specs = [TensorSpec(p.numel(), dtype.itemsize, dtype, self.device) for p, dtype in zip(self.params, dtypes)]
        groups = bucket_groups(specs, order, self.caps, self.per_bucket_caps, self.first_guess_limits)
        self.buckets = [Bucket(k, [self.params[i] for i in group], [self.names[i] for i in group], group,
                               dtypes[group[0]], self.storage)
                        for k, group in enumerate(groups)]
        # 1. Each parameter's bucket and its position there, worked out once.
        self._plan: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for position, i in enumerate(bucket.indices):
                self._plan[i] = (bucket, position)
        self.next_bucket = 0  # the next bucket to launch, in order

    def prepare_for_backward(self, output) -> None:
        """Arm the reducer: the next backward averages (called at the end of a synchronized forward)."""
        self.armed = True

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True).get_future()

    def _average_grad(self, index: int, param: torch.Tensor) -> None:
        if not self.armed:
            return
        if not self.backward_running:  # 3. the first hook of this backward
            self.backward_running = True
            _engine.queue_callback(self._finish_backward)
        bucket, position = self._plan[index]
        torch.mul(param.grad, self.factor, out=bucket.views[position])  # 2. divide, then sum
        bucket.mark_ready_at(position)
        # Collectives are matched by order across ranks: a bucket leaves only
        # after every bucket before it, even if it filled first.
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self.buckets[self.next_bucket].launch(lambda b: self._all_reduce(b.buffer))  # launch, and go on
            self.next_bucket += 1

    def _finish_backward(self) -> None:
        # 3. Autograd calls this when the whole backward pass is done.
        self.armed = self.backward_running = False
        assert self.next_bucket == len(self.buckets), "a parameter got no gradient this step"
        for bucket in self.buckets:
            bucket.wait()
            torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)  # the averages, out of the bucket
            bucket.reset()
        self.next_bucket = 0
