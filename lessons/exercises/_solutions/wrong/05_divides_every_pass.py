"""Exercise 05 with post-accumulate hooks (the right kind) that divide ``.grad`` by the world size on every
backward, synchronized or not: right with one backward per step; with micro-batches the earlier ones' gradients
are divided again on every later pass. Its grade must not blame ``Tensor.register_hook``, which it does not use."""

from pathlib import Path

import torch.distributed as dist

from lessons.grading.runner import load

EXPECT = "is not the plain gradient"
right = load(Path(__file__).resolve().parent.parent / "05_gradient_hooks.py")


class HookAverager(right.HookAverager):
    def _average(self, param) -> None:
        param.grad /= self.world_size  # on every pass: the accumulated earlier micro-batches too
        if self.require_sync:
            dist.all_reduce(param.grad)
