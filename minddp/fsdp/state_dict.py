"""Full state dicts: every parameter whole, by its original name, as an unsharded model has them.

torch's own helpers work too (the parameters are DTensors):
``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
options=StateDictOptions(full_state_dict=True))`` gathers each parameter
with ``full_tensor()``. :func:`full_state_dict` is the same answer in one
all-gather per unit: each unit's shard in its master dtype (fp32, whatever
the compute dtype), cut back into parameters. Units are visited in module order, the same on every rank, so
the all-gathers pair up. What ``load_state_dict`` of an unsharded copy of the
model accepts, this returns; :func:`load_full_state_dict` goes the other way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minddp.fsdp.fully_shard import units_of
from minddp.fsdp.unit import ShardedUnit

__all__ = ["full_state_dict", "load_full_state_dict", "full_parameters"]


def full_parameters(model: nn.Module) -> dict[int, torch.Tensor]:
    """``id(shard parameter) -> full tensor`` for every unit in ``model`` (a collective)."""
    found: dict[int, torch.Tensor] = {}
    for unit in units_of(model):
        for shard_param, full in zip(unit.shard_params, unit.gather_master()):
            found[id(shard_param)] = full
    return found


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``, unsharded, by name (a collective: call it on every rank).

    ``rank0_only=True``: the other ranks get an empty dict (they still take part).
    """
    full = full_parameters(model)
    units = units_of(model)
    if rank0_only and dist.get_rank(units[0].group if units else None) != 0:
        return {}
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        out[name] = full[id(value)] if id(value) in full else value.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put full tensors (as :func:`full_state_dict` returns) into ``model``'s shards, parameters and buffers."""
    shard_of: dict[int, tuple[ShardedUnit, int]] = {}
    for unit in units_of(model):
        for index, shard_param in enumerate(unit.shard_params):
            shard_of[id(shard_param)] = (unit, index)
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            if name not in state:
                raise KeyError(f"load_full_state_dict: {name!r} is missing from the state dict")
            if id(value) in shard_of:
                unit, index = shard_of[id(value)]
                first, length = unit.spans[index]
                unit.locals[index].view(-1).copy_(state[name].reshape(-1)[first: first + length])
            else:
                value.copy_(state[name])
