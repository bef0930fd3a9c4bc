"""Making replicas identical: the first broadcast of the weights, and the buffers' policies before a forward.

None of these run per gradient; they run once at construction (the first
broadcast) or once per forward (buffers: :class:`BufferSync`). Checking that
replicas *are* identical lives in :mod:`minddp.ddp.replicas`; the graph walk of
``find_unused_parameters`` in :mod:`minddp.ddp.parts.unused_parameters`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from minddp.ddp.placement import global_rank

__all__ = ["BUFFER_POLICIES", "broadcast_coalesced", "sync_buffers", "BufferSync"]

BUFFER_POLICIES = ("broadcast", "with_gradients", "average", "off")

# torch's DDP broadcasts in chunks of 250 MiB: few collectives, bounded extra memory.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values, in few collectives.

    Tensors are packed into flat chunks (one dtype and device each, at most
    250 MiB), so a model with hundreds of small tensors costs a handful of
    broadcasts instead of hundreds. Values are written through ``.data``: a
    buffer overwritten between two forwards must not bump its autograd version
    counter, or the first forward's backward would fail (pytorch issue 22095).
    """
    receiving = dist.get_rank(group) != src
    for chunk in _chunks(tensors):
        flat = _flatten(chunk)
        dist.broadcast(flat, src=global_rank(group, src), group=group)
        if receiving:
            _unflatten_into(flat, chunk)


def sync_buffers(buffers: Sequence[torch.Tensor], group: dist.ProcessGroup, policy: str, src: int = 0) -> None:
    """Make buffers agree before a forward, by ``policy``:

    * ``"broadcast"`` (torch's DDP): everyone takes rank ``src``'s buffers.
      Cheap, but BatchNorm's running statistics then only ever reflect the
      data rank 0 saw.
    * ``"average"``: floating-point buffers are averaged over ranks (every
      rank's data counts); integer buffers such as ``num_batches_tracked``,
      equal everywhere anyway, are broadcast.
    * ``"off"``: nothing.

    (``"with_gradients"`` is ``"broadcast"`` sent in the last gradient bucket,
    :mod:`minddp.ddp.parts.buffers_in_bucket`; where it cannot be, it is this broadcast.)
    """
    if policy == "off" or not buffers:
        return
    if policy in ("broadcast", "with_gradients"):
        broadcast_coalesced(buffers, group, src)
        return
    floating = [b for b in buffers if b.is_floating_point()]
    broadcast_coalesced([b for b in buffers if not b.is_floating_point()], group, src)
    world = dist.get_world_size(group)
    for chunk in _chunks(floating):
        flat = _flatten(chunk)
        dist.all_reduce(flat, group=group)
        _unflatten_into(flat.div_(world), chunk)


class BufferSync:
    """The forward-time part for ``buffer_sync="broadcast"`` or ``"average"``: before a forward that follows
    a synchronized one, the module's buffers (read anew each time: a forward may re-assign one) agree."""

    def __init__(self, read_buffers: Callable[[], list[torch.Tensor]], group: dist.ProcessGroup, policy: str):
        self.read_buffers, self.group, self.policy = read_buffers, group, policy

    def before_forward(self, source: int) -> None:
        sync_buffers(self.read_buffers(), self.group, self.policy, source)



def _flatten(chunk: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in chunk])


def _unflatten_into(flat: torch.Tensor, chunk: list[torch.Tensor]) -> None:
    offset = 0
    for t in chunk:
        t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _chunks(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    by_kind: dict[tuple, list[list[torch.Tensor]]] = {}
    sizes: dict[tuple, int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        chunks = by_kind.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if chunks[-1] and sizes[key] + nbytes > BROADCAST_CHUNK_BYTES:
            chunks.append([])
            sizes[key] = 0
        chunks[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [c for chunks in by_kind.values() for c in chunks if c]
