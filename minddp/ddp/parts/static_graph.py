"""``static_graph=True``: every iteration uses the same parameters the same number of times.

A readiness part. The first backward only counts each parameter's gradient
hooks and reduces everything at its end (a parameter that got none counts
as zero, now and always); later backwards mark a parameter ready at its
*last* expected hook. This is what lets a block run twice under a reentrant
activation checkpoint (two nested passes, two hooks). Which parameters some
rank uses is learned once, with the first backward. A graph that changes
after all is an error, in torch's words; the first backward's end is
watched from the pass that computes the output's gradient ([Note: hooks
only in nested passes]). Its gradients part is
:class:`~minddp.ddp.parts.gradient_cases.GradientCases` (a parameter
unused in the first backward has no ``.grad``).
"""

from __future__ import annotations

from typing import Any

import torch

from minddp.ddp.parts.unused_parameters import mark_the_rest_ready, tensors_in, used_on_any_rank
from minddp.ddp.core.reducer import EveryHookReady

__all__ = ["StaticGraph"]


class StaticGraph(EveryHookReady):
    """Readiness with ``static_graph=True`` (``find_unused``: ``find_unused_parameters`` given too)."""

    def __init__(self, count: int, find_unused: bool = False):
        self.count, self.find_unused = count, find_unused
        self.used_on_some_rank = None
        self.hooks_seen = [0] * count  # this backward, per parameter
        self.hooks_expected: list[int] | None = None  # learned by the first backward
        self._unused: list[int] = []  # parameters with no hook in the first backward
        self._unmarked: list[int] = []  # ... not yet counted ready in this backward

    def prepare_for_backward(self, reducer, output: Any) -> None:
        self.hooks_seen = [0] * self.count
        self._unmarked = list(self._unused)
        if self.hooks_expected is None:
            # [Note: hooks only in nested passes] The first backward launches
            # nothing before its end, which the end-of-pass check queued by its
            # first hook sees ([Note: nested passes], BackwardPhase). With every
            # parameter inside reentrant activation checkpoints, every hook
            # fires in a nested pass, each nested pass ends with every bucket
            # still to come (BETWEEN_PASSES), and the outer pass, which runs no
            # hook, would end without asking: the backward would never finish.
            # So the first gradient of the forward's output, which autograd
            # computes in the outer pass before any nested one starts, has the
            # reducer watch that pass's end (torch's _DDPSink queues its
            # _delay_all_reduce on the outer pass the same way). Later backwards
            # launch each bucket at its last expected hook: the last nested
            # pass ends with all of them launched.
            outputs = [t for t in tensors_in(output) if t.grad_fn is not None]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grad: reducer.watch_this_pass(), mode="any")

    def is_ready(self, reducer, index: int) -> bool:
        if self._unmarked:  # the first hook of the backward: no gradient will come for these
            unmarked, self._unmarked = self._unmarked, []
            for i in unmarked:
                reducer.mark_ready(i)
        self.hooks_seen[index] += 1
        if self.hooks_expected is None:
            return False  # the first backward: count only, reduce everything at its end
        if self.hooks_seen[index] > self.hooks_expected[index]:
            raise RuntimeError(
                f"MiniDDP(static_graph=True): Your training graph has changed in this iteration: parameter "
                f"{reducer.names[index]!r} got gradient {self.hooks_seen[index]} time(s), where the first "
                f"iteration gave it {self.hooks_expected[index]} (e.g. a parameter unused in the first "
                "iteration is used now). This is not compatible with static_graph set to True: construct "
                "MiniDDP(..., find_unused_parameters=True) without static_graph for a graph that changes.")
        return self.hooks_seen[index] == self.hooks_expected[index]  # its last hook: the gradient is complete

    def backward_ending(self, reducer) -> None:
        if self.hooks_expected is None:  # now we know how many hooks each parameter gets
            self.hooks_expected = list(self.hooks_seen)
            self._unused = [i for i, n in enumerate(self.hooks_expected) if n == 0]
            mark_the_rest_ready(reducer)
        elif self.find_unused:
            mark_the_rest_ready(reducer)
        if not all(bucket.ready for bucket in reducer.buckets):
            missing = reducer.abandon_unfinished_backward()
            raise RuntimeError(
                "MiniDDP(static_graph=True): Expected to have finished reduction in the prior iteration "
                "before starting a new one. This error indicates that your training graph has changed in "
                "this iteration, e.g., one parameter is used in first iteration, but then got unused in the "
                "second iteration. this is not compatible with static_graph set to True.\n"
                f"Parameters which did not receive grad: {missing}")
        self._learn_use(reducer)

    def _learn_use(self, reducer) -> None:
        if self.used_on_some_rank is None:  # learned once, by the first backward; the graph does not change
            hooks = self.hooks_expected or self.hooks_seen
            self.used_on_some_rank = used_on_any_rank([n > 0 for n in hooks], reducer)

    def shadow_backward(self, reducer) -> None:
        """A joined rank's stand-in for the first backward: it saw no hook, and says so."""
        if self.used_on_some_rank is None:
            self.hooks_seen = [0] * self.count
            self._learn_use(reducer)
