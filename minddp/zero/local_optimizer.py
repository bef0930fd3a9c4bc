"""What a ``ZeroRedundancyOptimizer`` cuts into shards, and the local optimizer that steps them.

Two decisions live here, apart from the step itself (``optimizer.py``):

* the flat units: each parameter group laid end to end and cut into N equal
  pieces (``partition="flat"``, the paper's), whole tensors to the least
  loaded rank (``"greedy"``, torch's), or, under stage 2, MiniDDP's own
  buckets, so that a bucket's reduce-scatter lands in its owner's shard;
* the local optimizer (any ``torch.optim`` class) over this rank's shard
  views, one view per parameter segment, in the caller's groups.

The partition can change after construction (a group added, stage 2's
buckets becoming final at the first step). The local optimizer is then
rebuilt, and a segment owned before and after (same parameter, same
elements) keeps its state: the state is per view, so nothing else moving
can disturb it.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from minddp.zero.partition import FlatUnit, Segment, flat_units, greedy_units
from minddp.zero.shards import ShardLayout
from minddp.zero.stage2 import bucket_units, missing_from

__all__ = ["params_of", "choose_units", "rebuild_local_optimizer", "copy_hyperparameters"]


def params_of(group: dict) -> list[torch.Tensor]:
    """Every parameter of a group, frozen or not (trainability is decided at each step, by
    ``.grad``, as torch does); a tied weight is one parameter, listed once."""
    return list({id(p): p for p in group["params"]}.values())


def choose_units(zero) -> list[FlatUnit]:
    """The flat units of ``zero``'s parameter groups, by its ``partition`` (stage 2: MiniDDP's buckets)."""
    mine = list({id(p): p for g in zero.param_groups for p in params_of(g)}.values())
    if zero.shard_gradients and not missing_from(zero):
        # MiniDDP's buckets; what it does not reduce (frozen when it was built), flat.
        units = bucket_units(zero.ddp, zero.world_size)
        bucketed = {id(p) for u in units for p in u.params}
        return units + flat_units([p for p in mine if id(p) not in bucketed], zero.world_size)
    if zero.shard_gradients:  # a group still to be added: retaken from the buckets at the first step
        return flat_units(mine, zero.world_size)
    totals = [0] * zero.world_size
    units: list[FlatUnit] = []
    for group in zero.param_groups:
        params = params_of(group)
        if params:
            units += flat_units(params, zero.world_size) if zero.partition == "flat" else \
                greedy_units(params, zero.world_size, totals)
    return units


def rebuild_local_optimizer(zero) -> tuple[ShardLayout, Optimizer]:
    """A new layout of ``zero``'s shards (filled from the parameters) and a local optimizer over them,
    carrying over the state of every segment ``zero``'s current layout also has."""
    group_of = {id(p): i for i, g in enumerate(zero.param_groups) for p in params_of(g)}
    units = choose_units(zero)
    if not units:
        raise ValueError("ZeroRedundancyOptimizer got no parameter")
    old_state = {}
    if zero.layout is not None:
        old_state = {_where(seg): zero.optim.state[view] for shard in zero.layout.shards
                     for seg, view in zip(shard.segments, shard.views) if view in zero.optim.state}
    layout = ShardLayout(units, group_of, zero.rank, zero.world_size)
    layout.fill(lambda s: s.master, lambda p: p.detach())
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [v for s in layout.shards_of_group(i) for v in s.views]}
              for i, group in enumerate(zero.param_groups)]
    optim = zero.optimizer_class(groups, **zero.optim_defaults)
    copy_hyperparameters(optim.param_groups, zero.param_groups)  # the class's defaults, seen by the caller
    for shard in layout.shards:
        for seg, view in zip(shard.segments, shard.views):
            if _where(seg) in old_state:
                optim.state[view] = old_state[_where(seg)]
    return layout, optim


def copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """Every setting but ``params`` from ``source``'s groups into ``target``'s (an LR scheduler's changes)."""
    for src, dst in zip(source, target):
        for key, value in src.items():
            if key != "params":
                dst[key] = value


def _where(segment: Segment) -> tuple:
    return id(segment.param), segment.param_start, segment.length
