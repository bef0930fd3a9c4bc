"""The trainer's optimizer: SGD with momentum, whole on every rank, or sharded by ZeRO (``--zero 1|2|3``).

``--zero 0`` (the default) is plain ``torch.optim.SGD``: every rank keeps the
whole momentum buffer. ``--zero 1`` wraps the same SGD in
:class:`minddp.zero.ZeroRedundancyOptimizer`: each rank keeps and steps
1/N of the momentum, and an all-gather brings the parameters back after the
step. ``--zero 2`` also shards the gradients: MiniDDP reduce-scatters each
bucket during backward instead of all-reducing it, so that needs MiniDDP
(``--ddp mini``). Both need the wrapper to exist first (stage 1 on MiniDDP
takes its shard of each bucket's all-reduce through a comm hook), which is
why the loop wraps the model before it builds the optimizer. ``--zero 3``
shards the parameters too (:mod:`minddp_lab.train.fully_sharded`: the model is
``fully_shard``'ed instead of wrapped in DDP, and SGD steps its shards).

Two places in the trainer must know that the state is sharded:

* clipping (:mod:`minddp_lab.train.step`): under stage 2 no parameter has a
  ``.grad``, and under stage 1 the shards already hold their copy of it, so
  ``torch.nn.utils.clip_grad_norm_`` would see nothing or change nothing.
  :func:`clip_gradients` calls the optimizer's own ``clip_grad_norm_`` (the
  squares summed over the shards, all-reduced: the global norm);
* checkpoints (:mod:`minddp_lab.train.resume`): :func:`optimizer_state` gathers
  the shards into torch's own format on rank 0 (a collective), so
  ``last.pt`` stays one atomic file, and its optimizer state loads onto any
  number of ranks and any ``--zero`` (the sharded optimizer keeps the
  elements it owns; plain SGD takes all of them).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from minddp_lab.train.fully_sharded import FullyShardedSGD
from minddp.zero import ZeroRedundancyOptimizer

__all__ = ["ZERO_STAGES", "build_optimizer", "clip_gradients", "optimizer_state", "describe_zero"]

ZERO_STAGES = (0, 1, 2, 3)
MOMENTUM = 0.9


def build_optimizer(model: torch.nn.Module, ddp_model: torch.nn.Module, args: argparse.Namespace,
                    lr: float) -> torch.optim.Optimizer:
    """SGD over ``model``'s parameters; sharded over the ranks when ``args.zero`` is 1, 2 or 3."""
    if args.zero == 3:  # ddp_model is model itself, fully sharded: SGD steps its shards
        return FullyShardedSGD(ddp_model, lr=lr, momentum=MOMENTUM)
    if args.zero == 0:
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    # ddp_model.parameters() are model's, in the same order: the optimizer's
    # parameter indices (and so its checkpoints) are those of plain SGD.
    return ZeroRedundancyOptimizer(
        ddp_model.parameters(), torch.optim.SGD, ddp=ddp_model, shard_gradients=args.zero == 2,
        lr=lr, momentum=MOMENTUM,
    )


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Scale the averaged gradients so that their global norm is at most ``max_norm``; return the norm."""
    if isinstance(optimizer, (ZeroRedundancyOptimizer, FullyShardedSGD)):
        return optimizer.clip_grad_norm_(max_norm)  # a collective: every rank calls it
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def optimizer_state(optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any] | None:
    """The optimizer's whole state in torch's format on rank 0, ``None`` on the others (call on every rank)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)  # every rank sends its shard, rank 0 assembles it on its CPU
        return optimizer.state_dict() if rank == 0 else None
    if isinstance(optimizer, FullyShardedSGD):
        whole = optimizer.consolidated_state_dict()  # every rank takes part in the gathers
        return whole if rank == 0 else None
    return optimizer.state_dict()


def describe_zero(stage: int, world_size: int) -> str:
    """For the startup line: what ``--zero`` shards ('' when off)."""
    if stage == 0:
        return ""
    what = {1: "optimizer state", 2: "optimizer state and gradients",
            3: "parameters, gradients and optimizer state"}[stage]
    return f", ZeRO stage {stage} ({what} sharded over {world_size} rank{'' if world_size == 1 else 's'})"
