"""``register_comm_hook(state, hook)``: a bucket's communication is ``hook(state, bucket)``, not an all-reduce.

torch's contract (see :mod:`minddp.comm_hooks` for the hooks themselves):
the hook gets the bucket's buffer *not* divided by the world size (the hook
averages), and returns a ``torch.futures.Future`` of the reduced buffer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from minddp.comm_hooks import GradBucket
from minddp.features import Layer

__all__ = ["CommHook"]


class CommHook(Layer):
    height = 12

    def attach(self, state: Any, hook: Callable) -> None:
        self.comm_hook = (state, hook)  # may be replaced later (minddp.zero.memory wraps it)
        self.scale = 1.0  # the hook does the averaging

    def detach(self) -> None:
        self.comm_hook = None
        self.scale = 1.0 / self.divisor

    def communicate(self, bucket) -> torch.futures.Future:
        state, hook = self.comm_hook
        future = hook(state, GradBucket(bucket, len(self.buckets)))
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and what collectives return
            raise RuntimeError(f"MiniDDP's comm hook {getattr(hook, '__name__', hook)!r}: callback must return a "
                               f"torch.futures.Future object, but got {type(future).__name__}")
        return future
