"""Lesson 07's wrapper: lesson 06's asynchronous all-reduces, of flat buckets launched in order."""

import torch
import torch.distributed as dist
import torch.nn as nn


class BucketDDP(nn.Module):
    """Lesson 06's AsyncDDP, all-reducing flat buckets instead of single tensors."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: float, link=None, broadcast: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False while accumulating micro-batches
        self.link = link
        self.pending = []  # (bucket index, flat tensor, future) launched during this backward
        self.bucket_cap_bytes = bucket_cap_bytes
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Without the broadcast each rank would train its own model from its own
        # random start; averaging gradients of different models means nothing.
        for p in self.module.parameters():
            if broadcast:
                dist.broadcast(p.data, src=0)
            if p.requires_grad:
                self._add_hook(p)
        # Reversed: backward produces the last layer's gradients first, so
        # the first bucket fills (and can leave) first.
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
        self.ready[self.bucket_of[param]] += 1
        # Collectives are matched by order across ranks: a bucket leaves only
        # after every bucket before it, even if it filled first.
        while self.next_bucket < len(self.buckets) and self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[self.next_bucket]])
            self.pending.append((self.next_bucket, flat, self._all_reduce(flat)))  # launch, and go on
            self.next_bucket += 1

    def finish_gradient_synchronization(self) -> None:
        # Called after backward, before optimizer.step().
        if not self.require_sync:
            return
        assert self.next_bucket == len(self.buckets), "a parameter got no gradient this step"
        for i, flat, future in self.pending:
            future.wait()
            flat /= self.world_size
            offset = 0
            for p in self.buckets[i]:  # unpack the bucket back into each .grad
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
