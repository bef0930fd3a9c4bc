"""Checkpoints of a sharded optimizer: consolidated, sharded, and resharded on load.

Optimizer state lives in shards, so a checkpoint is either

* **consolidated**: torch's own optimizer format (state per parameter index,
  shaped like the parameter), assembled on one rank's CPU, chunk by chunk
  (``ZeroRedundancyOptimizer.consolidate_state_dict(to=0)`` then
  ``state_dict()``). Loads into torch optimizers too; costs one full copy of
  the state in rank 0's host memory; or
* **sharded**: each rank writes only its own elements (:func:`save_sharded`),
  nothing is gathered anywhere.

Both are read through one idea: a *piece* is "elements ``[start, start +
length)`` of parameter ``i``" with its state values. A consolidated state is
one piece per parameter; a sharded checkpoint is one piece per segment of
the ranks that wrote it. Loading fills each of this rank's segments from the
pieces it overlaps (:func:`load_pieces`), so the partition at load time may
differ from the one at save time: another number of ranks, ``flat`` or
``greedy``, stage 1 or 2.
"""

from __future__ import annotations

import glob
import os
from itertools import chain
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["consolidate", "pieces_of_full", "load_pieces", "save_sharded", "load_sharded"]

# pieces: parameter index -> [(start, length, {state key: 1-D tensor})]; scalars: index -> {key: value}
Pieces = dict[int, list[tuple[int, int, dict[str, torch.Tensor]]]]


def _index_of(zero) -> dict[int, int]:
    return {id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in zero.param_groups))}


def _param_groups(zero) -> list[dict]:
    index_of, groups = _index_of(zero), []
    for group in zero.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [index_of[id(p)] for p in group["params"]]})
    return groups


def _is_sharded(value: Any, view: torch.Tensor) -> bool:
    """A state entry shaped like its segment (``exp_avg``), not a scalar (``step``)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == view.shape


def _segment_states(zero):
    """(segment, its view, its local optimizer state) for each of this rank's segments with state."""
    for shard in zero.layout.shards:
        for seg, view in zip(shard.segments, shard.views):
            state = zero.optim.state.get(view)
            if state:
                yield seg, view, state


def consolidate(zero, gather: Callable, receive: bool) -> dict | None:
    """torch's format on the receiving rank (None elsewhere); ``gather(shard_tensor, dest)`` is the collective.

    The local optimizer's state is per segment, and each parameter has its
    own scalars (Adam's ``step``: a parameter frozen for a while counts
    fewer): a small all-gather of every rank's scalars per parameter index,
    then one gather per state tensor, streamed into the CPU's memory.
    """
    index_of, layout = _index_of(zero), zero.layout
    mine: dict[int, tuple[dict, dict]] = {}  # parameter index -> (scalars, {sharded key: dtype})
    for seg, view, state in _segment_states(zero):
        mine[index_of[id(seg.param)]] = ({k: _clone(v) for k, v in state.items() if not _is_sharded(v, view)},
                                         {k: v.dtype for k, v in state.items() if _is_sharded(v, view)})
    everyone = [None] * zero.world_size
    dist.all_gather_object(everyone, mine, group=zero.process_group)
    known = {i: found for rank_state in everyone for i, found in rank_state.items()}
    keys = sorted({k for _, sharded in known.values() for k in sharded})
    full: dict[str, dict[int, torch.Tensor]] = {}
    for key in keys:
        full[key] = {}
        dtype = next(sharded[key] for _, sharded in known.values() if key in sharded)

        def dest(p, key=key, dtype=dtype):
            if id(p) not in full[key]:
                full[key][id(p)] = torch.zeros(p.shape, dtype=dtype, device="cpu")
            return full[key][id(p)]

        def shard_tensor(shard, key=key, dtype=dtype):  # the shard's segments' states end to end, zeros where none
            out = torch.zeros(shard.numel, dtype=dtype, device=shard.master.device)
            for offset, view in zip(shard.offsets, shard.views):
                state = zero.optim.state.get(view, {})
                if key in state:
                    out[offset: offset + view.numel()] = state[key]
            return out

        gather(shard_tensor, dest if receive else None)
    if not receive:
        return None
    params = {index_of[id(p)]: p for p in layout.params}
    state = {i: {**{k: full[k][id(params[i])] for k in sharded}, **scalars}
             for i, (scalars, sharded) in known.items()}
    return {"state": dict(sorted(state.items())), "param_groups": _param_groups(zero)}


def _clone(value: Any) -> Any:
    return value.detach().clone().cpu() if torch.is_tensor(value) else value


def pieces_of_full(state_dict: dict) -> tuple[Pieces, dict[int, dict]]:
    """A consolidated (torch-format) state as pieces: one per parameter, covering it."""
    pieces, scalars = {}, {}
    for index, st in state_dict["state"].items():
        tensors = {k: v.reshape(-1) for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        numel = next(iter(tensors.values())).numel() if tensors else 0
        pieces[int(index)] = [(0, numel, tensors)]
        scalars[int(index)] = {k: v for k, v in st.items() if k not in tensors}
    return pieces, scalars


def load_pieces(zero, loaded: tuple[Pieces, dict[int, dict]], param_groups: list[dict]) -> None:
    """Fill this rank's shards of optimizer state from pieces, whatever partition wrote them."""
    pieces, scalars = loaded
    if len(param_groups) != len(zero.param_groups):
        raise ValueError(f"the state has {len(param_groups)} parameter groups, the optimizer "
                         f"{len(zero.param_groups)}")
    index_of = _index_of(zero)
    zero.optim.state.clear()
    for shard in zero.layout.shards:
        for seg, view in zip(shard.segments, shard.views):
            index = index_of[id(seg.param)]
            if index not in scalars:
                continue  # no state saved for this parameter (never stepped)
            state = {k: _clone(v) for k, v in scalars[index].items()}
            for key, sample in pieces.get(index, [(0, 0, {})])[0][2].items():
                state[key] = torch.zeros(seg.length, dtype=sample.dtype, device=view.device)
                _fill_segment(state[key], pieces[index], seg.param_start, key)
            zero.optim.state[view] = state
    for group, saved in zip(zero.param_groups, param_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for local, group in zip(zero.optim.param_groups, zero.param_groups):
        local.update({k: v for k, v in group.items() if k != "params"})


def _fill_segment(out: torch.Tensor, pieces: list, start: int, key: str) -> None:
    """``out`` = elements ``[start, start + len(out))`` of a parameter's ``key``, from the pieces covering it."""
    end, covered = start + out.numel(), 0
    for lo, length, tensors in pieces:
        a, b = max(start, lo), min(end, lo + length)
        if a < b:
            out[a - start: b - start] = tensors[key][a - lo: b - lo]
            covered += b - a
    if covered != out.numel():
        raise ValueError(f"the checkpoint covers {covered} of {out.numel()} elements of a parameter's {key!r}")


# ------------------------------------------------------------------ sharded files
def sharded_state_dict(zero) -> dict:
    """This rank's elements of the optimizer state, addressed by parameter index (no collective)."""
    index_of, pieces, scalars = _index_of(zero), {}, {}
    for seg, view, st in _segment_states(zero):
        index = index_of[id(seg.param)]
        tensors = {k: v.detach().cpu().clone() for k, v in st.items() if _is_sharded(v, view)}
        pieces.setdefault(index, []).append((seg.param_start, seg.length, tensors))
        scalars[index] = {k: _clone(v) for k, v in st.items() if not _is_sharded(v, view)}
    return {"world_size": zero.world_size, "rank": zero.rank, "pieces": pieces, "scalars": scalars,
            "param_groups": _param_groups(zero)}


def save_sharded(zero, directory: str) -> str:
    """Write this rank's shard to ``directory/optimizer.rank{r}-of-{n}.pt`` (every rank calls it)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"optimizer.rank{zero.rank}-of-{zero.world_size}.pt")
    torch.save(sharded_state_dict(zero), path)
    return path


def load_sharded(zero, directory: str) -> None:
    """Load the shards every rank wrote to ``directory``, onto this optimizer's partition (any world size).

    Files are memory-mapped: a rank reads the pages of the elements it owns.
    """
    paths = sorted(glob.glob(os.path.join(directory, "optimizer.rank*-of-*.pt")))
    if not paths:
        raise FileNotFoundError(f"no optimizer.rank*-of-*.pt in {directory}")
    shards = [torch.load(path, mmap=True, weights_only=True) for path in paths]
    written = {s["world_size"] for s in shards}
    if len(written) != 1 or len(shards) != written.pop():
        raise ValueError(f"{directory} holds {len(shards)} shard files of world sizes "
                         f"{sorted({s['world_size'] for s in shards})}: an incomplete or mixed checkpoint")
    pieces: Pieces = {}
    scalars: dict[int, dict] = {}
    for shard in shards:
        for index, found in shard["pieces"].items():
            pieces.setdefault(index, []).extend(found)
        scalars.update(shard["scalars"])
    zero.load_state_pieces((pieces, scalars), shards[0]["param_groups"])
