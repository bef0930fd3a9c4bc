"""Exercise 05: averaging inside backward, with a hook per parameter (lesson 05).

Write ``register_hooks`` below; then, from the repository's root:

    python -m lessons.grade 05

The grader trains the lessons' bench model through ``HookAverager`` on 3
ranks, once with one backward per step and once accumulating 2 micro-batches
(``require_sync`` is False for all but the last), and compares with one
process on the whole batch. It also checks that the weights are left alone
and that nothing is sent while ``require_sync`` is False.

It also trains a family of models (a frozen parameter, one without a gradient
in some steps, a weight shared by two layers) and a bfloat16 copy of one: each
gradient travels, and stays, in its own dtype.
"""

import torch.distributed as dist
from torch import nn


class HookAverager:
    """Averages every gradient over the ranks from inside backward: no call needed afterwards."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False while accumulating micro-batches: average only after the last
        self.register_hooks()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def register_hooks(self) -> None:
        """Register, on every parameter that requires a gradient, a hook that averages its gradient.

        The hook must run once the gradient of this backward pass has been
        *added* to ``param.grad``, so that with accumulation it averages all
        micro-batches together; and only when ``self.require_sync`` is True.
        """
        raise NotImplementedError
