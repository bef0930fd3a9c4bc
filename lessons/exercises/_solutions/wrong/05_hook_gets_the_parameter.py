"""Exercise 05 with lesson 05's mistake B: the post-accumulate hook written as if it got the gradient."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "mistake B"
right = load(Path(__file__).resolve().parent.parent / "05_gradient_hooks.py")
import torch.distributed as dist  # noqa: E402


class HookAverager(right.HookAverager):
    def register_hooks(self) -> None:
        for p in self.module.parameters():
            p.register_post_accumulate_grad_hook(self._average)

    def _average(self, grad) -> None:  # really the parameter
        if self.require_sync:
            dist.all_reduce(grad.data)
            grad.data /= self.world_size
