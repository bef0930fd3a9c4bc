"""Exercise 07 that fills its buckets in the order the gradients arrive: bucket k takes the next
``len(self.buckets[k])`` gradients to arrive, whichever they are, and leaves when it has them. It launches strictly
in order, bucket 0 first, but when ranks' gradients arrive in different orders their buckets hold different
parameters, summed together. Its grade must name that, not the launching order."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

EXPECT = "held other gradients"
right = load(Path(__file__).resolve().parent.parent / "07_buckets.py")


class BucketAverager(right.BucketAverager):
    def __init__(self, module, bucket_cap_bytes: int):
        super().__init__(module, bucket_cap_bytes)
        self.arrived, self.launched = [], []

    def _on_gradient(self, param) -> None:
        if not self.require_sync:
            return
        self.arrived.append(param)
        if len(self.arrived) == len(self.buckets[len(self.launched)]):  # the next bucket: whatever arrived
            flat = torch.cat([p.grad.reshape(-1) for p in self.arrived])
            self.launched.append((self.arrived, flat, dist.all_reduce(flat, async_op=True)))
            self.arrived = []

    def finish(self) -> None:
        if not self.require_sync:
            return
        for params, flat, work in self.launched:
            work.wait()
            flat /= self.world_size
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.launched = []
