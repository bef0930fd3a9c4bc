"""Exercise 06 whose hook ignores require_sync: right numbers, but it sends on every micro-batch."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "require_sync False"

right = load(Path(__file__).resolve().parent.parent / "06_async_overlap.py")

import torch.distributed as dist  # noqa: E402


class AsyncAverager(right.AsyncAverager):
    def _launch(self, param) -> None:
        self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))  # also while accumulating
