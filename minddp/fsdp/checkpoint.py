"""Sharded checkpoints: each rank writes its own pieces; any number of ranks reads them back.

No rank ever holds the whole model. A rank's file says, for every parameter
by name, which elements of the flattened parameter it held (``first``,
``length``), their values, and the optimizer's state for them (AdamW's moments
are shaped like the shard, so they are pieces of the same elements). To
resume on M ranks, each rank works out the elements it now holds and copies
them from whichever old files cover them: the bytes are the same, bit for
bit, whatever M is. Scalar state (AdamW's ``step``) is the same on every rank
and is taken from any file. Parameters outside every unit and buffers are
replicated; they come from the reader's own old rank if it had one, else
from rank 0.

Files: ``directory/rank{r}.pt``, one per rank, plus nothing else: the world
size a checkpoint was written with is the number of files.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from minddp.fsdp.fully_shard import units_of

__all__ = ["save_sharded", "load_sharded"]


def _spans(model: nn.Module) -> dict[int, tuple[int, int]]:
    """``id(shard parameter) -> (first element held, how many)`` for every unit in ``model``.

    A rank holds rows of each parameter (``Shard(0)``): in the flattened
    parameter, one run of elements."""
    return {id(p): span for unit in units_of(model) for p, span in zip(unit.shard_params, unit.spans)}


def _flat_local(value: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a shard parameter (or of optimizer state shaped like it), flattened, copied."""
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.detach().reshape(-1).clone()


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: str) -> None:
    """Write this rank's pieces of ``model`` (and ``optimizer``'s state) to ``directory/rank{r}.pt``."""
    spans = _spans(model)
    pieces, replicated, states = {}, {}, {}
    for name, p in model.named_parameters():
        if id(p) in spans:
            pieces[name] = {"first": spans[id(p)][0], "values": _flat_local(p)}
        else:
            replicated[name] = p.detach().clone()
        if optimizer is not None and p in optimizer.state:
            states[name] = {k: (_flat_local(v) if isinstance(v, DTensor) else v.clone() if torch.is_tensor(v) else v)
                            for k, v in optimizer.state[p].items()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
    os.makedirs(directory, exist_ok=True)
    torch.save({"pieces": pieces, "replicated": replicated, "buffers": buffers, "optimizer_state": states,
                "param_groups": groups}, os.path.join(directory, f"rank{dist.get_rank()}.pt"))
    dist.barrier()  # every file is written before anyone reads


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: str) -> None:
    """Fill ``model`` (and ``optimizer``) from a checkpoint written by :func:`save_sharded` on any number of ranks."""
    count = len([f for f in os.listdir(directory) if f.startswith("rank") and f.endswith(".pt")])
    files = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=True) for r in range(count)]
    mine = files[dist.get_rank()] if dist.get_rank() < count else files[0]
    spans = _spans(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in spans:
                first, length = spans[id(p)]
                p.to_local().view(-1).copy_(_assemble(files, name, first, length, lambda f: f["pieces"][name]["values"]))
            else:
                p.copy_(mine["replicated"][name])
            if optimizer is not None:
                state = _state_for(files, name, spans.get(id(p)), p)
                if state:
                    optimizer.state[p] = state
        for name, b in model.named_buffers():
            b.copy_(mine["buffers"][name])
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, mine["param_groups"]):
            group.update(saved)


def _assemble(files: list[dict], name: str, first: int, length: int, values_of) -> torch.Tensor:
    """Elements ``[first, first + length)`` of parameter ``name``, copied from the old ranks that held them."""
    out, covered = None, 0
    for f in files:
        old_first = f["pieces"][name]["first"]
        old = values_of(f)
        if out is None:
            out = torch.empty(length, dtype=old.dtype, device=old.device)
        lo, hi = max(first, old_first), min(first + length, old_first + old.numel())
        if lo < hi:
            out[lo - first: hi - first] = old[lo - old_first: hi - old_first]
            covered += hi - lo
    if covered != length:
        raise ValueError(f"load_sharded: the checkpoint's files cover {covered} of the {length} elements "
                         f"of {name!r} this rank needs (a file missing, or from another model?)")
    return out


def _state_for(files: list[dict], name: str, span: tuple[int, int] | None, param: torch.Tensor) -> dict:
    """The optimizer state of parameter ``name`` for this rank's elements (None: nobody stepped it),
    a DTensor like ``param`` where the state is shaped like the shard."""
    having = [f for f in files if name in f["optimizer_state"]]
    if not having:
        return {}
    state = {}
    for key, value in having[0]["optimizer_state"][name].items():
        if span is not None and torch.is_tensor(value) and value.dim() == 1:  # shaped like the shard
            flat = _assemble(having, name, *span, lambda f: f["optimizer_state"][name][key])
            local = param.to_local()
            state[key] = DTensor.from_local(flat.view(local.shape), param.device_mesh, param.placements,
                                            run_check=False, shape=param.shape, stride=param.stride())
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value
    return state
