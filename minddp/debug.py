"""Catching replicas that drifted apart.

Data parallelism rests on one invariant: every rank holds the same
parameters and buffers at the start of every step. It breaks silently: an
optimizer step skipped on one rank, a random augmentation of the weights, a
``load_state_dict`` on rank 0 only, a buffer updated from local data. Training
then goes on and the loss just looks a bit worse.

:func:`check_replicas_in_sync` compares a cheap checksum of every parameter
and buffer across ranks, in one collective, and raises on every rank, naming
the first tensor that differs and the ranks that disagree.
``MiniDDP(..., check_sync_every=N)`` runs it at every N-th synchronized
forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ReplicaDesyncError", "check_replicas_in_sync", "checksums"]


class ReplicaDesyncError(RuntimeError):
    """The ranks' copies of the model differ."""


def checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two numbers per tensor, in float64: the plain sum and a position-weighted sum.

    The weighted sum catches permuted or swapped values that leave the plain
    sum unchanged. Equal tensors give bit-identical checksums on every rank
    (same values, same reduction order on the same kind of device).
    """
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        rows.append(torch.stack([flat.sum(), (flat * weights).sum() / max(flat.numel(), 1)]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def check_replicas_in_sync(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ReplicaDesyncError` on every rank if any parameter or buffer differs.

    A collective: every rank of ``group`` must call it at the same point.
    Pass the unwrapped module or the MiniDDP wrapper; names are reported as
    ``module.named_parameters()`` / ``named_buffers()`` give them.
    """
    named = list(module.named_parameters()) + list(module.named_buffers())
    mine = checksums([t for _, t in named])
    device = named[0][1].device if named else torch.device("cpu")
    everyone = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine.to(device), group=group)
    reference = everyone[0]
    for i, (name, _) in enumerate(named):
        differing = [rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs[i], reference[i])]
        if differing:
            raise ReplicaDesyncError(
                f"replicas are out of sync: {name!r} on rank(s) {differing} differs from rank 0 "
                f"(checksums {reference[i].tolist()} on rank 0, {everyone[differing[0]][i].tolist()} on "
                f"rank {differing[0]}). Look for a step, a load or a random change that ran on some ranks only."
            )
