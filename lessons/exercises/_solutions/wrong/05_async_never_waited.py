"""Exercise 05 launching each hook's all-reduce with async_op=True and never waiting: right only by luck."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "never waited for"
right = load(Path(__file__).resolve().parent.parent / "05_gradient_hooks.py")
import torch.distributed as dist  # noqa: E402


class HookAverager(right.HookAverager):
    def _average(self, param) -> None:
        if self.require_sync:
            dist.all_reduce(param.grad, async_op=True)  # the sum may land any time, or after the step
            param.grad /= self.world_size
