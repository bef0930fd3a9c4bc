"""Exercise 05 whose hook ignores require_sync: exact, but it sends on every micro-batch."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "require_sync False"
right = load(Path(__file__).resolve().parent.parent / "05_gradient_hooks.py")
import torch.distributed as dist  # noqa: E402


class HookAverager(right.HookAverager):
    def _average(self, param) -> None:
        dist.all_reduce(param.grad)
        param.grad /= self.world_size
