"""Exercise 05 with lesson 05's mistake A: Tensor.register_hook, which runs before accumulation."""

from pathlib import Path

from lessons.grading.runner import load

EXPECT = "mistake A"
right = load(Path(__file__).resolve().parent.parent / "05_gradient_hooks.py")
import torch.distributed as dist  # noqa: E402


class HookAverager(right.HookAverager):
    def register_hooks(self) -> None:
        for p in self.module.parameters():
            p.register_hook(self._average_this_pass)

    def _average_this_pass(self, grad):
        if self.require_sync:
            grad = grad.clone()
            dist.all_reduce(grad)
            grad /= self.world_size
        return grad
