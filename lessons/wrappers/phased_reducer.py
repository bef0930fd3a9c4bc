"""Lesson 07c, step 4: where a backward is, as one phase instead of flags; the names the library uses.

``armed`` and ``backward_running`` become one :class:`BackwardPhase`, as
FSDP2 keeps its ``TrainingState``: IDLE (hooks let gradients accumulate:
``no_sync()``), ARMED (a synchronized forward ended), REDUCING (its backward's
hooks fire). The methods take the names they have in
``minddp/ddp/core/reducer.py``.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minddp.ddp.core.assignment import MiB, TensorSpec, bucket_groups, first_guess_limits
from minddp.ddp.core.buckets import Bucket, BucketStorage
from minddp.ddp.core.reducer import ReducerOptions

_engine = torch.autograd.Variable._execution_engine


class BackwardPhase(enum.Enum):
    """Where the reducer is, from the end of a synchronized forward to the end of its backward.

    ::

        IDLE ──prepare_for_backward──> ARMED ──first hook──> REDUCING ──finish_backward──> IDLE

    A forward inside ``no_sync()`` (or without grad) leaves it IDLE: the
    hooks see IDLE and let the gradients accumulate.
    """

    IDLE = "idle"  # no averaging backward armed: hooks do nothing
    ARMED = "armed"  # a synchronized forward ended: its backward averages; no hook yet
    REDUCING = "reducing"  # hooks fire; the end-of-pass callback is queued on autograd's engine


class PhasedReducer:
    """Averages the gradients of ``params`` over ``process_group`` during backward."""

    def __init__(self, params: list[nn.Parameter], names: list[str], process_group: dist.ProcessGroup,
                 options: ReducerOptions):
        self.params, self.names, self.options = params, names, options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.device = params[0].device
        self.scale = 1.0 / self.world_size  # what each gradient is multiplied by before the sum
        self.phase = BackwardPhase.IDLE
        self.storage = BucketStorage()
        self.caps = (int(options.bucket_cap_mb * MiB), int(options.first_bucket_cap_mb * MiB))
        self.per_bucket_caps = [int(cap * MiB) for cap in options.bucket_caps_mb or ()]  # [] unless given
        self.first_guess_limits = first_guess_limits(self.caps, self.per_bucket_caps, options)
        self._build_buckets(None if options.learn_bucket_order else list(reversed(range(len(params)))))  # 1st guess
        for index, p in enumerate(params):  # fires after p.grad is accumulated
            p.register_post_accumulate_grad_hook(functools.partial(self._autograd_hook, index))

    def _build_buckets(self, order: list[int] | None) -> None:
        """Build the buckets for parameter indices in expected-arrival ``order``, by ``caps``; ``None``:
        torch's first guess, before a backward has shown the order (:mod:`minddp.ddp.core.assignment`)."""
        dtypes = [self.options.reduce_dtype or p.dtype for p in self.params]  # what each gradient is reduced in
        specs = [TensorSpec(p.numel(), dtype.itemsize, dtype, self.device) for p, dtype in zip(self.params, dtypes)]
        groups = bucket_groups(specs, order, self.caps, self.per_bucket_caps, self.first_guess_limits)
        self.buckets = [Bucket(k, [self.params[i] for i in group], [self.names[i] for i in group], group,
                               dtypes[group[0]], self.storage)
                        for k, group in enumerate(groups)]
        # The plan every hook follows, worked out once here instead of at every
        # gradient: parameter index -> (its bucket, its position there).
        self._plan: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for position, i in enumerate(bucket.indices):
                self._plan[i] = (bucket, position)
        self._next_to_launch = 0

    # ------------------------------------------------------- at every forward
    def prepare_for_backward(self, output: Any) -> None:
        """Arm the reducer: the next backward averages. Called at the end of a synchronized forward, with
        its output (where unused parameters are searched for)."""
        if self.phase is BackwardPhase.IDLE:
            self.phase = BackwardPhase.ARMED

    # ------------------------------------------------ the path of a gradient
    def _autograd_hook(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate hook of ``params[index]``: its ``.grad`` is final for this backward."""
        phase = self.phase
        if phase is BackwardPhase.IDLE:
            return  # inside no_sync(): the gradient just accumulates
        if phase is not BackwardPhase.REDUCING:  # the first hook of this backward
            _engine.queue_callback(self.finish_backward)
            self.phase = BackwardPhase.REDUCING
        self.mark_ready(index)

    def mark_ready(self, index: int) -> None:
        """Count ``params[index]`` ready in its bucket; the copy waits until the bucket is complete."""
        bucket, position = self._plan[index]
        if bucket.mark_ready_at(position):
            self.bucket_ready(bucket)

    def bucket_ready(self, bucket: Bucket) -> None:
        """Its gradients into the bucket, then launch every complete bucket, strictly in bucket order:
        a bucket complete early waits for the ones before it, so every rank issues the same
        all-reduces in the same order."""
        bucket.copy_in([p.grad for p in bucket.params], bucket.views, self.scale)
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            self.launch(self.buckets[self._next_to_launch])
            self._next_to_launch += 1

    def launch(self, bucket: Bucket) -> None:
        """Start ``bucket``'s all-reduce (it is complete, and every bucket before it has left)."""
        bucket.launch(lambda b: dist.all_reduce(b.buffer, group=self.process_group, async_op=True).get_future())

    # ------------------------------------------------------ end of backward
    def finish_backward(self) -> None:
        """Every bucket launched? Then wait for each, write ``.grad``, and be ready for the next backward."""
        self.phase = BackwardPhase.IDLE
        assert self._next_to_launch == len(self.buckets), "a parameter got no gradient this step"
        for bucket in self.buckets:
            bucket.wait()
            torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)
            bucket.reset()
        self._next_to_launch = 0
