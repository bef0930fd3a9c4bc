"""Exercise 07 launching each bucket as soon as it is full, in whatever order buckets fill."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "different orders"
right = load(Path(__file__).resolve().parent.parent / "07_buckets.py")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class BucketAverager(right.BucketAverager):
    def _on_gradient(self, param) -> None:
        if not self.require_sync:
            return
        i = self.bucket_of[param]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # full: send it now, before earlier buckets
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
            self.pending.append((i, flat, dist.all_reduce(flat, async_op=True)))
            self.next_bucket += 1
