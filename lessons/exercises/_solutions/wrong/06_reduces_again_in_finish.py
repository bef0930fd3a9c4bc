"""Exercise 06 that, after waiting for each gradient's all-reduce, all-reduces the averaged gradients once more
(asynchronously, and waits): the numbers stay right, every gradient crosses the network twice a step."""

from pathlib import Path

import torch.distributed as dist

from lessons.grading.runner import load

EXPECT = "twice"
right = load(Path(__file__).resolve().parent.parent / "06_async_overlap.py")


class AsyncAverager(right.AsyncAverager):
    def finish(self) -> None:
        params = [param for param, _ in self.pending]
        super().finish()
        again = [(p, dist.all_reduce(p.grad, async_op=True)) for p in params]  # "make sure the ranks agree"
        for p, work in again:
            work.wait()
            p.grad /= self.world_size
