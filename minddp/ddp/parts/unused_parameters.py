"""``find_unused_parameters=True``: parameters that get no gradient on some rank count as zero there.

Without it, a parameter the forward did not use never fires its hook, its
bucket never completes, and the plain path stops at the end of backward
with an error naming it. With it, as in torch's DDP, two parts:

* readiness, :class:`UnusedParameters`: after each synchronized forward,
  the autograd graph of the output is walked (:func:`params_reached_from`);
  a parameter it does not reach will get no gradient, so it is counted
  ready at the backward's first hook, and its bucket need not wait for it.
  At the end of backward, a parameter reached but still without a gradient
  (an output left out of the loss) counts as ready too, in bucket order.
  One small all-reduce then tells which parameters have a gradient on
  *some* rank (torch's ``local_used_map``: a hook with a defined gradient
  since the last synchronized backward, ``no_sync()`` micro-batches
  included; here, a ``.grad`` already there as the backward starts, or
  one defined at its hook: an undefined gradient leaves it None); with ``skip_all_reduce_unused_params``
  (a promise that the unused ones stay the same on every rank) it is done
  at the first backward only;
* gradients, :class:`~minddp.ddp.parts.gradient_cases.GradientCases`: a
  parameter without ``.grad`` contributes zeros; one that had a gradient on
  no rank keeps its ``.grad`` (None stays None), the others get the average.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist

import minddp.ddp.core.messages as messages
from minddp.ddp.core.reducer import EveryHookReady

__all__ = ["UnusedParameters", "params_reached_from", "tensors_in", "used_on_any_rank", "mark_the_rest_ready"]


class UnusedParameters(EveryHookReady):
    """Readiness with ``find_unused_parameters=True``."""

    def __init__(self, params: list[torch.nn.Parameter], skip_all_reduce: bool = False):
        self.params, self.skip_all_reduce = params, skip_all_reduce
        self.used_on_some_rank = None
        self._unmarked: list[int] = []  # not reached by this forward's graph, not yet counted ready
        self._used_here = [True] * len(params)  # a gradient on this rank since the last synchronization?
        self._warned = False  # about a first forward that used every parameter

    def prepare_for_backward(self, reducer, output: Any) -> None:
        with torch.autograd.profiler.record_function("minddp.search_unused_parameters"):  # torch's name for it
            reached = params_reached_from(output)
        self._unmarked = [i for i, p in enumerate(self.params) if id(p) not in reached]
        if not self._warned and not self._unmarked:  # once, as torch's: the flag may have been for nothing
            warnings.warn(messages.nothing_unused(reducer), stacklevel=2)
        self._warned = True
        self._used_here = [p.grad is not None for p in self.params]  # accumulated under no_sync(), say

    def is_ready(self, reducer, index: int) -> bool:
        if self._unmarked:  # the first hook of the backward: no gradient will come for these (torch's way)
            unmarked, self._unmarked = self._unmarked, []
            for i in unmarked:
                reducer.mark_ready(i)
        if self.params[index].grad is not None:  # (a hook may bring an undefined gradient)
            self._used_here[index] = True
        return True

    def backward_ending(self, reducer) -> None:
        mark_the_rest_ready(reducer)  # reached by the walk, but no gradient came: zero as well
        if not (self.skip_all_reduce and self.used_on_some_rank is not None):
            self.used_on_some_rank = used_on_any_rank(self._used_here, reducer)

    def shadow_backward(self, reducer) -> None:
        """A joined rank's stand-in: it used nothing, and says so in the same all-reduce."""
        if not (self.skip_all_reduce and self.used_on_some_rank is not None):
            self.used_on_some_rank = used_on_any_rank([False] * len(self.params), reducer)


def mark_the_rest_ready(reducer) -> None:
    """Count every parameter still without a gradient as ready (its slot: zeros), in bucket order."""
    for bucket in reducer.buckets:
        for index in bucket.unready_indices():
            reducer.mark_ready(index)


def used_on_any_rank(used_here: list[bool], reducer) -> list[bool]:
    """Which parameters got a gradient on some rank (one small all-reduce)."""
    used = torch.tensor(used_here, dtype=torch.int32, device=reducer.device)
    dist.all_reduce(used, group=reducer.process_group)
    return [bool(u) for u in used.tolist()]


def tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor in a forward's output: nested in lists, tuples (named too),
    dicts (a HuggingFace ``ModelOutput`` is one) and dataclass fields, as torch's DDP looks."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))


def params_reached_from(outputs: Any) -> set[int]:
    """``id`` of every leaf tensor that the autograd graph of ``outputs`` reaches.

    Walks ``grad_fn.next_functions`` from each output tensor; a leaf shows up
    as an ``AccumulateGrad`` node whose ``variable`` is the parameter. A
    parameter not reached will get no gradient in this backward, so MiniDDP
    counts it as zero instead of waiting for it forever.
    """
    reached: set[int] = set()
    seen: set = set()
    stack = []
    for t in tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))  # a parameter returned as is
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return reached
