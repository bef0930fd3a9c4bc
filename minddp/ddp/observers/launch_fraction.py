"""The launch fraction: how much of the gradient left before backward's compute ended.

Overlap is communication that runs while backward still computes. On a
2-core machine the time hidden that way is too small to read from a clock,
but what makes it possible can be counted: the gradient bytes whose
all-reduce *started* before the last backward node (the last autograd node
that computes, not an ``AccumulateGrad``) ended. Eager MiniDDP on eight
equal layers, one bucket each: 7/8 (the last bucket can only leave after the
last node). Compiled whole: 0 (one node, every hook after it).

It is an order of events, not a duration, so it reads the same on a loaded
machine and in a test: each computing node of the step's backward gets a
post-hook (:meth:`LaunchFraction.watch`, given the loss), each bucket launch
is logged, and the fraction is read from the log. It says whether overlap
*can* happen, not how much time it saves: that needs a link and a clock
(``benchmarks/compile_overlap.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minddp.ddp.core.slots import Observer

__all__ = ["LaunchFraction", "LaunchReport", "backward_nodes"]


def backward_nodes(loss: torch.Tensor) -> list:
    """Every autograd node ``loss.backward()`` will run that computes (not an ``AccumulateGrad``)."""
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@dataclass(frozen=True)
class LaunchReport:
    """One backward, counted: its computing nodes, how many of them compiled pieces, and the bytes."""

    nodes: int
    compiled_nodes: int  # AOT autograd's CompiledFunctionBackward: one per compiled graph or piece
    launched_early: int  # gradient bytes whose all-reduce started before the last node ended
    launched: int  # gradient bytes launched in all

    @property
    def fraction(self) -> float:
        return self.launched_early / self.launched if self.launched else 0.0

    def __str__(self) -> str:
        return (f"{self.nodes} backward nodes ({self.compiled_nodes} compiled); {self.launched_early} of "
                f"{self.launched} gradient bytes launched before the last one ended: {self.fraction:.3f}")


class LaunchFraction(Observer):
    """Counts one backward's launches against its last node: ``watch(loss)``, ``backward()``, ``report()``.

    For MiniDDP, add it as an observer (``model.reducer.add_observer``); for torch's DDP, :meth:`torch_ddp_hook`
    is a comm hook that logs each bucket, then all-reduces it as torch's default does.
    """

    def __init__(self):
        self.log: list[int | None] = []  # a launch's bytes, or None: a computing node ended
        self.nodes = self.compiled_nodes = 0

    def watch(self, loss: torch.Tensor) -> None:
        """Before ``loss.backward()``: log the end of each of its computing nodes."""
        self.log = []
        nodes = backward_nodes(loss)
        self.nodes = len(nodes)
        self.compiled_nodes = sum("CompiledFunction" in type(node).__name__ for node in nodes)
        for node in nodes:
            node.register_hook(self._node_ended)

    def _node_ended(self, grad_inputs, grad_outputs) -> None:
        self.log.append(None)

    def bucket_launching(self, bucket) -> None:
        self.log.append(sum(p.numel() * p.element_size() for p in bucket.params))

    def torch_ddp_hook(self, process_group, bucket):  # (no annotations: torch checks them against its own types)
        """A comm hook for torch's DDP (``ddp.register_comm_hook(None, fraction.torch_ddp_hook)``): a bucket's
        ``dist.GradBucket`` logged, then all-reduced as torch's default does; a future of the average."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.log.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(process_group, bucket)

    def report(self) -> LaunchReport:
        """After the backward: the counts (the last node is the last ``None`` in the log)."""
        last_node = max((k for k, entry in enumerate(self.log) if entry is None), default=-1)
        launches = [(k, entry) for k, entry in enumerate(self.log) if entry is not None]
        return LaunchReport(self.nodes, self.compiled_nodes, sum(b for k, b in launches if k < last_node),
                            sum(b for _, b in launches))
