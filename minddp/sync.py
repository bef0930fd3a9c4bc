"""Helpers that make replicas identical: broadcasting, and the buffers' policies before a forward.

None of these run per gradient; they run once at construction (the first
broadcast) or once per forward (buffers: :class:`BufferSync`). Checking that
replicas *are* identical lives in :mod:`minddp.replicas`; the graph walk of
``find_unused_parameters`` in :mod:`minddp.features.unused_parameters`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

__all__ = [
    "module_device", "on_device", "move_to_device", "broadcast_coalesced", "sync_buffers", "BufferSync",
    "global_rank", "process_group_of",
]

BUFFER_POLICIES = ("broadcast", "with_gradients", "average", "off")

# torch's DDP broadcasts in chunks of 250 MiB: few collectives, bounded extra memory.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def process_group_of(process_group: dist.ProcessGroup | None, device_mesh: Any = None) -> dist.ProcessGroup:
    """The ranks to average over: ``process_group``, or a one-dimensional ``device_mesh``'s, or the world."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    return process_group if process_group is not None else dist.group.WORLD


def global_rank(group: dist.ProcessGroup, group_rank: int = 0) -> int:
    """``dist.broadcast`` takes a *global* rank as source, even inside a subgroup."""
    return group_rank if group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def module_device(params: list[torch.Tensor], device_ids: list | None = None) -> torch.device:
    """The one device the module's parameters are on; ``device_ids`` must name it, if given.

    A module spread over two devices is refused, as torch's DDP refuses one
    on two device types: its gradient hooks would fire on two autograd
    device threads at once, and the reducer's launch order is kept by one.
    ``device_ids`` take what torch's DDP takes: an int (a CUDA index), a
    string or a ``torch.device``; ``torch.device("cuda")`` without an index
    means the current CUDA device.
    """
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            "MiniDDP's input module must be on one device, but its parameters locate in "
            f"{sorted(map(str, devices))}; move the whole module to one device (model.to(device)) first"
        )
    device = devices.pop()
    if device_ids is None:
        return device
    wanted = [_as_device(d) for d in device_ids]
    if len(wanted) != 1 or wanted[0] != device:
        raise ValueError(
            f"device_ids={device_ids} but the module's parameters are on {[str(device)]}; "
            "MiniDDP supports one device per process: pass device_ids=[the module's device] or None"
        )
    return device


def _as_device(d: int | str | torch.device) -> torch.device:
    device = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Run collectives with ``device`` as the current CUDA device (nothing elsewhere).

    Object collectives (``all_gather_object``) and a fresh NCCL communicator
    use the *current* CUDA device, not the tensors'. torch's tutorial form
    ``DDP(model.to(rank), device_ids=[rank])`` sets no device: without this,
    every rank would meet on ``cuda:0`` ("Duplicate GPU detected", or a hang).
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def move_to_device(inputs: Any, device: torch.device) -> Any:
    """Every tensor in ``inputs`` (nested in lists, tuples, dicts) on ``device``, as torch's DDP
    does with the forward's inputs when ``device_ids`` is given. ``non_blocking``: a copy from
    pinned memory overlaps with the GPU's work (ordered before it on the current stream)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), inputs)


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
    :mod:`minddp.features.buffers_in_bucket`; where it cannot be, it is this broadcast.)
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
