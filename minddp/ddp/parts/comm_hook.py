"""``register_comm_hook(state, hook)``: a bucket's communication is ``hook(state, bucket)``, not an all-reduce.

A communication part. torch's contract (see :mod:`minddp.ddp.default_hooks` for
the hooks themselves): the hook gets the bucket's buffer *not* divided by
the world size (the hook averages: ``divides_first`` is False), and returns
a ``torch.futures.Future`` of the reduced buffer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from minddp.ddp.default_hooks import GradBucket, check_comm_hook

__all__ = ["CommHook", "register_comm_hook"]


def register_comm_hook(ddp, state: Any, hook: Callable) -> None:
    """``MiniDDP.register_comm_hook``: replace the all-reduce of each bucket by ``hook(state, bucket) ->
    Future[Tensor]``. torch's contract: once, before the first backward; the hook does the averaging
    (MiniDDP no longer divides by the world size for it)."""
    if ddp.reducer.communication.comm_hook is not None:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
    if ddp.reducer.backwards_done or ddp.reducer.backward_started:
        raise RuntimeError("register_comm_hook must be called before the first backward")
    check_comm_hook(hook)
    ddp.reducer.set_communication(CommHook(ddp.reducer, state, hook))
    ddp._buffers_by_broadcast()  # a hook need not be a sum: buffers go back to their broadcast


class CommHook:
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
