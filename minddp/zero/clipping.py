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

__all__ = ["clip_shards_by_global_norm_"]


def clip_shards_by_global_norm_(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                                group: dist.ProcessGroup) -> torch.Tensor:
    """Scale this rank's shard gradients ``grads`` in place so the norm over every rank's is at most
    ``max_norm``; returns that global norm. A collective: every rank calls it, in the same order."""
    device = grads[0].device
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max() if g.numel() else torch.zeros((), device=device) for g in grads]).max()
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        local = sum((g.float().abs().pow(norm_type).sum() for g in grads), torch.zeros((), device=device))
        dist.all_reduce(local, group=group)
        total = local.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch's: never scaled up
    torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return total
