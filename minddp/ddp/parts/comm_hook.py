"""``register_comm_hook(state, hook)``: a bucket's communication is ``hook(state, bucket)``, not an all-reduce.

A communication part, chosen by ``MiniDDP.register_comm_hook``. torch's contract (see :mod:`minddp.ddp.default_hooks` for
the hooks themselves): the hook gets the bucket's buffer *not* divided by
the world size (the hook averages: ``divides_first`` is False), and returns
a ``torch.futures.Future`` of the reduced buffer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from minddp.ddp.core.slots import Communication
from minddp.ddp.default_hooks import GradBucket

__all__ = ["CommHook"]


class CommHook(Communication):
    """Communication by a comm hook (``reducer``: whose buckets, for ``GradBucket.is_last``)."""

    divides_first = False  # the hook does the averaging

    def __init__(self, reducer, state: Any, hook: Callable):
        self.reducer, self.state, self.hook = reducer, state, hook
        self.name = getattr(hook, "__qualname__", type(hook).__name__)  # as torch's logging data names it

    @property
    def comm_hook(self) -> tuple[Any, Callable]:
        return self.state, self.hook

    def communicate(self, bucket) -> torch.futures.Future:
        future = self.hook(self.state, GradBucket(bucket, len(self.reducer.buckets)))
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and what collectives return
            raise RuntimeError(f"MiniDDP's comm hook {getattr(self.hook, '__name__', self.hook)!r}: callback must "
                               f"return a torch.futures.Future object, but got {type(future).__name__}")
        return future
