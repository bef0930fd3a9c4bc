"""The floor under every DDP step on this machine: the ``bound`` column.

Whatever a data-parallel wrapper does, each step must compute the bare
model's step (forward, backward, optimizer) and move every gradient byte
through one all-reduce. The cheapest way to move them is a single call on
one flat buffer: one latency, no bucket bookkeeping, no copies. So the
benchmark times, in the same rounds as everything else:

* ``local``: the bare model's step, no communication;
* ``forward``: the bare model's forward pass and loss alone (autograd on, as
  in training; the graph is dropped), so that ``local - forward`` is
  backward and the optimizer step;
* ``allreduce_flat``: one ``all_reduce`` of a buffer as large as all the
  gradients (in the wire dtype of the comm hook), nothing else.

How they add up depends on whether communication can run *while* the model
computes:

* ``sum`` (bound = local + flat): the ranks have no core to spare. Gloo's
  all-reduce sums and copies on a CPU thread of each rank; with 2 ranks of 1
  compute thread on 2 cores, that thread takes its turn on the same cores as
  backward, so no DDP can hide any of it;
* ``max`` (the DDP overlap bound, bound = forward + max(backward and step,
  flat)): every rank has a core beyond its compute threads, or the
  collectives run on a GPU's own streams (NCCL), or the ranks talk over a
  real, rate-limited link (``compare.py --link``), where the all-reduce
  mostly waits on the wire and leaves the cores to backward. A gradient
  exists only once backward has made it, so the all-reduce can hide under
  backward (and, where a wrapper lets it, the step), never under forward.

Both are paired by round (the bound of round *i* from that round's blocks)
as the wrapper overhead is, and each wrapper's distance to the bound,
``over_bound_<wrapper>_ms``, is the median over rounds of (its block - the
bound of the same round); ``x_bound_<wrapper>``, its step over the bound.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist

from minddp_lab.auto.costs import spare_core_per_rank

FLAT = "allreduce_flat"  # the name of the flat all-reduce among the timed steps
FORWARD = "forward"  # the forward pass timed alone
RULES = {"sum": "local + allreduce_flat", "max": "forward + max(backward and step, allreduce_flat)"}


def bound_rule(device: str, world_size: int, threads_per_rank: int, cpu_count: int | None = None,
               link: str = "loopback") -> str:
    """``"max"`` where communication can overlap compute, else ``"sum"`` (see the module doc).

    On CPU every rank needs a core beyond its ``threads_per_rank`` compute
    threads for Gloo's; ``world_size`` ranks are assumed on this one machine,
    as ``compare.py`` starts them.
    """
    if device == "cuda" or link != "loopback":
        return "max"
    return "max" if spare_core_per_rank(world_size, threads_per_rank, cpu_count) else "sum"


def flat_allreduce_step(params: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """A step that all-reduces one flat buffer holding as many elements as ``params``, in ``dtype``."""
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)

    def step() -> None:
        dist.all_reduce(buffer)

    step.count = [0]
    return step


def forward_step(module: torch.nn.Module, forward_loss: Callable[[torch.nn.Module], torch.Tensor]) -> Callable[[], None]:
    """A step that runs ``forward_loss(module)`` alone, autograd on, and drops the graph (no backward)."""

    def step() -> None:
        forward_loss(module)

    step.count = [0]
    return step


def bound_per_round(blocks: dict[str, list[float]], rule: str) -> list[float]:
    """Round i's bound from round i's ``local``, ``allreduce_flat`` (and, for ``max``, ``forward``) blocks."""
    if rule not in RULES:
        raise ValueError(f"bound rule must be one of {', '.join(RULES)}, got {rule!r}")
    if rule == "sum":
        return [local + flat for local, flat in zip(blocks["local"], blocks[FLAT])]
    if FORWARD not in blocks:
        raise ValueError(f"the {rule!r} bound ({RULES[rule]}) needs the {FORWARD!r} block, timed alone")
    return [fwd + max(local - fwd, flat) for fwd, local, flat in zip(blocks[FORWARD], blocks["local"], blocks[FLAT])]


def bound_figures(blocks: dict[str, list[float]], rule: str, wrappers: list[str]) -> dict[str, float]:
    """One run's ``bound_ms`` and each wrapper's ``over_bound_<w>_ms`` and ``x_bound_<w>`` (step / bound)."""
    per_round = bound_per_round(blocks, rule)
    out = {"bound_ms": statistics.median(per_round)}
    for name in wrappers:
        out[f"over_bound_{name}_ms"] = statistics.median(t - b for t, b in zip(blocks[name], per_round))
        out[f"x_bound_{name}"] = statistics.median(t / b for t, b in zip(blocks[name], per_round))
    return out
