"""Gradient clipping by the global norm when each rank holds only a shard of the gradients.

``torch.nn.utils.clip_grad_norm_`` computes the norm of the gradients it is
given. Under ZeRO each rank has 1/N of them (its shard gradients), so the norm
of its own would be wrong on every rank. The global norm is still one number:
for a p-norm, the sum of ``|g|^p`` over all elements is the sum over ranks of
each rank's partial sum (one all-reduce of a scalar); for the infinity norm,
the max of the ranks' maxima. Every rank then scales its shard by the same
coefficient, which is exactly what clipping the whole gradient would do.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["clip_shards_by_global_norm_", "global_norm", "scale_to_max_norm_"]


def clip_shards_by_global_norm_(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                                group: dist.ProcessGroup) -> torch.Tensor:
    """Scale this rank's shard gradients ``grads`` in place so the norm over every rank's is at most
    ``max_norm``; returns that global norm. A collective: every rank calls it, in the same order."""
    total = global_norm(grads, norm_type, group)
    scale_to_max_norm_(grads, max_norm, total)
    return total


def global_norm(shards: list[torch.Tensor], norm_type: float, group: dist.ProcessGroup | None,
                replicated: list[torch.Tensor] = (), device: torch.device | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of every rank's ``shards`` together (one all-reduce of a scalar; ``group``
    None: none, the shards are whole) and of ``replicated``, the same on every rank (counted once)."""
    device = device if device is not None else (shards or replicated)[0].device
    if math.isinf(norm_type):
        total = _largest(shards, device)
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return torch.maximum(total, _largest(replicated, device)) if replicated else total
    total = _sum_of_powers(shards, norm_type, device)
    if group is not None:
        dist.all_reduce(total, group=group)
    if replicated:
        total = total + _sum_of_powers(replicated, norm_type, device)
    return total.pow(1.0 / norm_type)


def scale_to_max_norm_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale ``grads`` in place by ``max_norm / total`` if their norm ``total`` is larger (as torch's: never up)."""
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for dtype in dict.fromkeys(g.dtype for g in grads):
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], coefficient.to(dtype))


def _largest(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([g.abs().max().float() if g.numel() else torch.zeros((), device=device) for g in grads]).max()


def _sum_of_powers(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    return sum((g.float().abs().pow(norm_type).sum() for g in grads), torch.zeros((), device=device))
