"""Gradient clipping over shards: the global norm, as if the gradients were whole.

``torch.nn.utils.clip_grad_norm_`` on shard parameters would see only this
rank's elements and return a local norm (FSDP2 gets the global one because
its parameters are DTensors that know they are sharded; ours are plain
tensors, which is what keeps the optimizer cheap). Every element of a unit
lives on exactly one rank, so the squares of the shards' gradients summed
over the ranks (one all-reduce) are the squares of the full gradients.
Parameters outside every unit are replicated: their squares count once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minddp.fsdp.fully_shard import units_of

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of ``model`` so that their global norm is at most ``max_norm``; return that norm.

    A collective: call it on every rank. ``norm_type``: 2.0 or ``inf``.
    """
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
    units = units_of(model)
    sharded = {id(p) for unit in units for p in unit.shard_params}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    shard_grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) in sharded]
    replicated = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in sharded]
    device = grads[0].device
    if norm_type == 2.0:
        total = _sum_of_squares(shard_grads, device)
        if units:
            dist.all_reduce(total, group=units[0].group)
        total = (total + _sum_of_squares(replicated, device)).sqrt()
    else:
        total = _largest(shard_grads, device)
        if units:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=units[0].group)
        total = torch.maximum(total, _largest(replicated, device))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel():
            total += torch.linalg.vector_norm(g.float()) ** 2
    return total


def _largest(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel():
            total = torch.maximum(total, g.detach().abs().max().float())
    return total
