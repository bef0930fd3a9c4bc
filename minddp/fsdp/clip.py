"""Gradient clipping over shards: the global norm, as if the gradients were whole.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` works as on
FSDP2: the shard parameters and their gradients are DTensors, which know
they are sharded, so its norm is a partial sum that DTensor all-reduces.
This one does the same in one all-reduce of a scalar over the local rows,
and also takes a model with parameters outside every unit (plain tensors,
which torch's cannot mix with DTensors). Every element of a unit
lives on exactly one rank, so the squares of the shards' gradients summed
over the ranks (one all-reduce) are the squares of the full gradients.
Parameters outside every unit are replicated: their squares count once.
"""

from __future__ import annotations

import torch
from torch import nn

from torch.distributed.tensor import DTensor

from minddp.fsdp.fully_shard import units_of
from minddp.zero.clipping import global_norm, scale_to_max_norm_

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of ``model`` so that their global norm is at most ``max_norm``; return that norm.

    A collective: call it on every rank. ``norm_type``: 2.0 or ``inf``. The norm and the scaling are
    ZeRO's (:mod:`minddp.zero.clipping`): the same question, shards of gradients on every rank.
    """
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
    units = units_of(model)
    sharded = {id(p) for unit in units for p in unit.shard_params}
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    shard_grads = [_local(g) for p in model.parameters() if (g := p.grad) is not None and id(p) in sharded]
    replicated = [g for p in model.parameters() if (g := p.grad) is not None and id(p) not in sharded]
    total = global_norm(shard_grads, norm_type, units[0].group if units else None, replicated, grads[0].device)
    scale_to_max_norm_(grads, max_norm, total)
    return total


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad
