"""Are the replicas the same? Checked once at construction, and on demand while training.

:func:`check_same_parameters` runs when MiniDDP is built: every rank must
wrap the same model (names, shapes, dtypes, ``requires_grad``), or the ranks
would build different buckets and issue mismatched collectives.

Catching replicas that drifted apart later:

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

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ReplicaDesyncError", "check_replicas_in_sync", "check_same_parameters", "checksums"]


class ReplicaDesyncError(RuntimeError):
    """The ranks' copies of the model differ."""


def checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two numbers per tensor, in float64: the plain sum and a position-weighted sum.

    The weighted sum, ``sum_i (n - i) x_i``, is the sum of the running sums,
    and catches permuted or swapped values that leave the plain sum unchanged.
    Both accumulate in float64 without a float64 copy of the tensor (one
    temporary: the running sums). Equal tensors give bit-identical checksums
    on every rank (same values, same reduction order on the same kind of
    device). Nothing here waits for the GPU.
    """
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        rows.append(torch.stack([flat.sum(dtype=torch.float64), flat.cumsum(0, dtype=torch.float64).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def check_replicas_in_sync(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`ReplicaDesyncError` on every rank if any parameter or buffer differs.

    A collective: every rank of ``group`` must call it at the same point.
    Pass the unwrapped module or the MiniDDP wrapper; names are reported as
    ``module.named_parameters()`` / ``named_buffers()`` give them. One wait
    for the GPU per check (the verdict), not one per tensor.
    """
    named = list(module.named_parameters()) + list(module.named_buffers())
    device = named[0][1].device if named else torch.device("cpu")
    mine = checksums([t for _, t in named]).to(device)
    everyone = torch.empty((dist.get_world_size(group), *mine.shape), dtype=mine.dtype, device=device)
    dist.all_gather(list(everyone.unbind(0)), mine, group=group)  # each rank's rows land in its slice
    differs = (everyone != everyone[:1]).any(dim=-1)  # [rank, tensor]
    if not bool(differs.any()):
        return
    first = int(differs.any(dim=0).nonzero()[0])  # only now, on the way to an error, read the details
    differing = differs[:, first].nonzero().flatten().tolist()
    raise ReplicaDesyncError(
        f"replicas are out of sync: {named[first][0]!r} on rank(s) {differing} differs from rank 0 "
        f"(checksums {everyone[0, first].tolist()} on rank 0, {everyone[differing[0], first].tolist()} on "
        f"rank {differing[0]}). Look for a step, a load or a random change that ran on some ranks only."
    )


def _describe(module: nn.Module, ignored: set[str]) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()
            if name not in ignored]


def check_same_parameters(module: nn.Module, group: dist.ProcessGroup, ignored: set[str] = frozenset()) -> None:
    """Raise on *every* rank if the ranks' parameters differ in count, name, shape, dtype or requires_grad
    (those named in ``ignored``, which MiniDDP leaves to the user, may differ).

    Different models would build different buckets and issue mismatched
    collectives: a hang, or silently mixed gradients. Every rank gathers every
    other rank's description, so all reach the same verdict and raise the same
    error together instead of some of them waiting forever.
    """
    mine = _describe(module, ignored)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for i in range(max(len(reference), len(theirs))):
            ours = reference[i] if i < len(reference) else None
            other = theirs[i] if i < len(theirs) else None
            if ours != other:
                raise RuntimeError(
                    "MiniDDP expects the same model on every rank, but parameter "
                    f"#{i} differs between rank 0 and rank {rank}: rank 0 has {_fmt(ours)}, "
                    f"rank {rank} has {_fmt(other)} (rank 0 has {len(reference)} parameters, "
                    f"rank {rank} has {len(theirs)})"
                )


def _fmt(entry) -> str:
    if entry is None:
        return "nothing"
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad else ", requires_grad=False"
    return f"{name!r} of shape {list(shape)} and {dtype}{frozen}"
