"""Lesson 07c, step 0: 07b's gradient path as a class of its own, apart from the module.

``FlatDDP`` was the module and the reducer at once. Here the module side
(rank 0's start, a forward that arms the reducer) is ``reducing_module.py``,
and this class is only what happens to a gradient, as torch splits its
``DistributedDataParallel`` (Python) from its ``Reducer`` (C++). The learned
order leaves too: buckets come in reverse registration order, the first guess.
"""

import torch
import torch.distributed as dist


class SplitReducer:
    """Lesson 07b's FlatDDP without the module: persistent buckets, divide first, an end-of-backward callback."""

    def __init__(self, params: list, names: list, process_group, options):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.factor = 1 / self.world_size  # 2. what each gradient is multiplied by before the sum
        self.armed = False  # did a synchronized forward arm the next backward?
        self.futures = []  # launched during this backward, bucket by bucket
        self.bucket_cap_bytes = options.bucket_cap_mb * 2**20
        self.params = params
        self.names = dict(zip(params, names))
        self.backward_running = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._average_grad)
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
        # 1. One buffer per bucket, allocated once; each parameter's slot is a view.
        self.buffers_ = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in self.buckets]
        self.slot = {}
        for buffer, bucket in zip(self.buffers_, self.buckets):
            offset = 0
            for p in bucket:
                self.slot[p] = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    def prepare_for_backward(self, output) -> None:
        """Arm the reducer: the next backward averages (called at the end of a synchronized forward)."""
        self.armed = True

    def _all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True).get_future()

    def _average_grad(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        if not self.backward_running:  # 3. the first hook of this backward
            self.backward_running = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
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
        self.armed = self.backward_running = False
