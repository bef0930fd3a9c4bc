"""Helpers that make replicas identical: broadcasting, buffer policies, finding used parameters.

None of these run per gradient; they run once at construction (the first
broadcast), once per forward (buffers), or once per forward with
``find_unused_parameters`` (the graph walk). Checking that replicas *are*
identical lives in :mod:`minddp.replicas`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_device_ids", "broadcast_coalesced", "sync_buffers", "params_reached_from", "global_rank"]

BUFFER_POLICIES = ("broadcast", "average", "off")

# torch's DDP broadcasts in chunks of 250 MiB: few collectives, bounded extra memory.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def global_rank(group: dist.ProcessGroup, group_rank: int = 0) -> int:
    """``dist.broadcast`` takes a *global* rank as source, even inside a subgroup."""
    return group_rank if group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def check_device_ids(device_ids: list | None, params: list[torch.Tensor]) -> None:
    """``device_ids`` is accepted for drop-in compatibility with torch's DDP; it must
    name the one device the parameters are already on."""
    if device_ids is None:
        return
    devices = {p.device for p in params}
    wanted = {torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in device_ids}
    if len(wanted) != 1 or wanted != devices:
        raise ValueError(
            f"device_ids={device_ids} but the module's parameters are on {sorted(map(str, devices))}; "
            "MiniDDP supports one device per process: move the module there and pass device_ids=None"
        )


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
    """
    if policy == "off" or not buffers:
        return
    if policy == "broadcast":
        broadcast_coalesced(buffers, group, src)
        return
    floating = [b for b in buffers if b.is_floating_point()]
    broadcast_coalesced([b for b in buffers if not b.is_floating_point()], group, src)
    world = dist.get_world_size(group)
    for chunk in _chunks(floating):
        flat = _flatten(chunk)
        dist.all_reduce(flat, group=group)
        _unflatten_into(flat.div_(world), chunk)


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


def _tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def params_reached_from(outputs: Any) -> set[int]:
    """``id`` of every leaf tensor that the autograd graph of ``outputs`` reaches.

    Walks ``grad_fn.next_functions`` from each output tensor; a leaf shows up
    as an ``AccumulateGrad`` node whose ``variable`` is the parameter. A
    parameter not reached will get no gradient in this backward, so MiniDDP
    counts it as zero instead of waiting for it forever.
    """
    reached: set[int] = set()
    seen: set = set()
    stack = []
    for t in _tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))  # a parameter returned as is
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return reached
