"""Exercise 07 that forgets to reset its counters in finish(): after step 1 no bucket ever leaves again."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "step 2 sent 0 all-reduces"
right = load(Path(__file__).resolve().parent.parent / "07_buckets.py")


class BucketAverager(right.BucketAverager):
    def finish(self) -> None:
        if not self.require_sync:
            return
        for i, flat, work in self.pending:
            work.wait()
            flat /= self.world_size
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending.clear()  # self.ready and self.next_bucket are left as they are
