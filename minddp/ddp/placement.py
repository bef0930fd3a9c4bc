"""Where a wrapped module lives: the process group it averages over, and its one device.

Read once at construction (``MiniDDP.__init__``), and at each forward for the
inputs (``move_to_device``) and the current CUDA device (``on_device``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

__all__ = ["process_group_of", "global_rank", "module_device", "on_device", "move_to_device"]


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
    if device.type == "cpu":  # torch's DDP refuses these too: a CPU module has no device to choose
        raise ValueError(
            f"device_ids={device_ids} given for a module on the CPU: device_ids name a GPU (one per process); "
            "for a CPU module leave them out: MiniDDP(model). (torch's DDP says: DistributedDataParallel "
            "device_ids and output_device arguments only work with single-device/multiple-device GPU modules "
            "or CPU modules.)"
        )
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
