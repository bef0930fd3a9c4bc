"""Lesson 07b's wrapper: lesson 07's buckets made persistent, with the five things a real DDP adds.

The numbers 1-5 in the comments are lesson 07b's; lesson 08's ``minddp.MiniDDP`` is this wrapper, packaged.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


class FlatDDP(nn.Module):
    """Lesson 07's BucketDDP with persistent buckets, a callback and a learned order."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: float, link=None, broadcast: bool = True,
                 learn_order: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.factor = 1 / self.world_size  # 2. what each gradient is multiplied by before the sum
        self.require_sync = True  # False while accumulating micro-batches
        self.link = link
        self.futures = []  # launched during this backward, bucket by bucket
        self.bucket_cap_bytes, self.learn_order = bucket_cap_bytes, learn_order
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {p: n for n, p in module.named_parameters()}
        self.arrival = []  # the order gradients really came, this backward
        self.backward_running = False
        # Without the broadcast each rank would train its own model from its own
        # random start; averaging gradients of different models means nothing.
        for p in self.module.parameters():
            if broadcast:
                dist.broadcast(p.data, src=0)
            if p.requires_grad:
                self._add_hook(p)
        if broadcast:  # 4. buffers too (BatchNorm's running statistics)
            for b in self.module.buffers():
                dist.broadcast(b.data, src=0)
        # Reversed: backward produces the last layer's gradients first, so
        # the first bucket fills (and can leave) first. A guess: see 5.
        self._build_buckets(list(reversed(self.params)))

    def _build_buckets(self, order: list) -> None:
        self.buckets, current, size = [], [], 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > self.bucket_cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        self.buckets.append(current)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # gradients arrived, per bucket
        self.next_bucket = 0  # the next bucket to launch, in order
        # 1. One buffer per bucket, allocated once; each parameter's slot is a view.
        self.buffers_ = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in self.buckets]
        self.slot = {}
        for buffer, bucket in zip(self.buffers_, self.buckets):
            offset = 0
            for p in bucket:
                self.slot[p] = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    def bucket_names(self) -> list:
        return [[self.names[p] for p in bucket] for bucket in self.buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _add_hook(self, p: torch.Tensor) -> None:
        p.register_post_accumulate_grad_hook(self._average_grad)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        if self.link is not None:  # the same sum, at the simulated network's pace
            return self.link.all_reduce(tensor)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def _average_grad(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        if not self.backward_running:  # 3. the first hook of this backward
            self.backward_running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self.arrival.append(param)
        torch.mul(param.grad, self.factor, out=self.slot[param])  # 2. divide, then sum
        self.ready[self.bucket_of[param]] += 1
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
        for p in self.params:
            p.grad.copy_(self.slot[p])  # the averaged value, out of the bucket
        self.futures.clear()
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
        self.backward_running = False
        if self.learn_order:  # 5. once: rebuild in the order rank 0 saw
            self.learn_order = False
            index = {p: i for i, p in enumerate(self.params)}
            order = torch.tensor([index[p] for p in self.arrival])
            dist.broadcast(order, src=0)
            self._build_buckets([self.params[i] for i in order.tolist()])
        self.arrival = []
