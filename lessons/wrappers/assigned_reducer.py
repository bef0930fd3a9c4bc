"""Lesson 07c, step 1: buckets assigned as torch assigns them, parameters known by their index.

Which parameters share a bucket is torch's rule now (a first bucket capped
at 1 MiB so the first all-reduce leaves early, one dtype per bucket, a cap
passed by at most one tensor): ``minddp/ddp/core/assignment.py``, read it
with this file. Each hook is told its parameter's index.
"""

import functools

import torch
import torch.distributed as dist

from minddp.ddp.core.assignment import MiB, TensorSpec, bucket_groups, first_guess_limits


class AssignedReducer:
    """Step 0's reducer, with torch's bucket assignment."""

    def __init__(self, params: list, names: list, process_group, options):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.factor = 1 / self.world_size  # 2. what each gradient is multiplied by before the sum
        self.armed = False  # did a synchronized forward arm the next backward?
        self.futures = []  # launched during this backward, bucket by bucket
        self.params, self.names, self.options = params, names, options
        self.device = params[0].device
        self.caps = (int(options.bucket_cap_mb * MiB), int(options.first_bucket_cap_mb * MiB))
        self.per_bucket_caps = [int(cap * MiB) for cap in options.bucket_caps_mb or ()]  # [] unless given
        self.first_guess_limits = first_guess_limits(self.caps, self.per_bucket_caps, options)
        self.backward_running = False
        for index, p in enumerate(params):
            p.register_post_accumulate_grad_hook(functools.partial(self._average_grad, index))
        # Reversed: backward produces the last layer's gradients first, so
        # the first bucket fills (and can leave) first.
        self._build_buckets(list(reversed(range(len(params)))))

    def _build_buckets(self, order: list) -> None:
        dtypes = [self.options.reduce_dtype or p.dtype for p in self.params]  # what each gradient is reduced in
        specs = [TensorSpec(p.numel(), dtype.itemsize, dtype, self.device) for p, dtype in zip(self.params, dtypes)]
        self.buckets = bucket_groups(specs, order, self.caps, self.per_bucket_caps, self.first_guess_limits)
        self.bucket_of = {i: k for k, bucket in enumerate(self.buckets) for i in bucket}
        self.ready = [0] * len(self.buckets)  # gradients arrived, per bucket
        self.next_bucket = 0  # the next bucket to launch, in order
        # 1. One buffer per bucket, allocated once; each parameter's slot is a view.
        self.buffers_ = [torch.zeros(sum(self.params[i].numel() for i in b), dtype=dtypes[b[0]]) for b in self.buckets]
        self.slot = {}
        for buffer, bucket in zip(self.buffers_, self.buckets):
            offset = 0
            for i in bucket:
                self.slot[i] = buffer[offset : offset + self.params[i].numel()].view_as(self.params[i])
                offset += self.params[i].numel()

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
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        torch.mul(param.grad, self.factor, out=self.slot[index])  # 2. divide, then sum
        self.ready[self.bucket_of[index]] += 1
        # Collectives are matched by order across ranks: a bucket leaves only
        # after every bucket before it, even if it filled first.
        while self.next_bucket < len(self.buckets) and self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
            self.futures.append(self._all_reduce(self.buffers_[self.next_bucket]))  # launch, and go on
            self.next_bucket += 1

    def _finish_backward(self) -> None:
        # 3. Autograd calls this when the whole backward pass is done.
        assert self.next_bucket == len(self.buckets), "a parameter got no gradient this step"
        for future in self.futures:
            future.wait()
        for i, p in enumerate(self.params):
            p.grad.copy_(self.slot[i])  # the averaged value, out of the bucket
        self.futures.clear()
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
        self.armed = self.backward_running = False
