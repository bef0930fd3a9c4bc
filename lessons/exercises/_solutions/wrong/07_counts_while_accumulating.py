"""Exercise 07 that counts arriving gradients even while require_sync is False: right only because finish()
resets the counts after every backward; a loop that calls it only after the synchronized one never launches."""

from pathlib import Path

import torch
import torch.distributed as dist

from lessons.grading.runner import load

EXPECT = 'with require_sync False, backward changed'
reference = load(Path(__file__).resolve().parent.parent / "07_buckets.py")


class BucketAverager(reference.BucketAverager):
    def _on_gradient(self, param: torch.Tensor) -> None:
        i = self.bucket_of[param]
        self.ready[i] += 1
        if not self.require_sync:
            return
        while self.next_bucket < len(self.buckets) and self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
            b = self.next_bucket
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
            self.pending.append((b, flat, dist.all_reduce(flat, async_op=True)))
            self.next_bucket += 1

    def finish(self) -> None:
        for b, flat, handle in self.pending:
            handle.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending = []
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
