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


def _is_sharded(value: Any, shard) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == shard.master.shape


def _shard_params(zero, shard) -> list[torch.Tensor]:
    """Every parameter (on any rank) of this shard's group and dtype."""
    seen, out = set(), []
    for p in chain.from_iterable(u.params for u in zero.layout.units):
        if zero.layout.group_of[id(p)] == shard.group and p.dtype == shard.master.dtype and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def consolidate(zero, gather: Callable, receive: bool) -> dict | None:
    """torch's format on the receiving rank (None elsewhere); ``gather(shard_tensor, dest)`` is the collective."""
    index_of, layout = _index_of(zero), zero.layout
    states = [zero.optim.state.get(s.master, {}) for s in layout.shards]
    keys = sorted({k for shard, st in zip(layout.shards, states) for k, v in st.items() if _is_sharded(v, shard)})
    full: dict[str, dict[int, torch.Tensor]] = {}
    for key in keys:  # one state tensor at a time, streamed into the CPU's memory
        full[key] = {}

        def dest(p, key=key):
            if id(p) not in full[key]:
                full[key][id(p)] = torch.zeros(p.shape, dtype=states[0][key].dtype, device="cpu")
            return full[key][id(p)]

        gather(lambda s, key=key: zero.optim.state[s.master][key], dest if receive else None)
    if not receive:
        return None
    state: dict[int, dict[str, Any]] = {}
    for shard, st in zip(layout.shards, states):
        if not st:
            continue
        for p in _shard_params(zero, shard):
            state[index_of[id(p)]] = {k: (full[k][id(p)] if k in full else _clone(v)) for k, v in st.items()}
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
        indices = [index_of[id(p)] for p in _shard_params(zero, shard)]
        known = [i for i in indices if i in scalars]
        if not known:
            continue  # no state saved for this group yet (saved before the first step)
        state = {k: _clone(v) for k, v in scalars[known[0]].items()}
        for key, sample in pieces.get(known[0], [(0, 0, {})])[0][2].items():
            buffer = torch.zeros(shard.numel, dtype=sample.dtype, device=shard.master.device)
            for seg, offset in zip(shard.segments, shard.offsets):
                _fill_segment(buffer[offset: offset + seg.length], pieces[index_of[id(seg.param)]],
                              seg.param_start, key)
            state[key] = buffer
        zero.optim.state[shard.master] = state
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
    for shard in zero.layout.shards:
        st = zero.optim.state.get(shard.master, {})
        if not st:
            continue
        for seg, offset in zip(shard.segments, shard.offsets):
            tensors = {k: v[offset: offset + seg.length].detach().cpu().clone() for k, v in st.items()
                       if _is_sharded(v, shard)}
            pieces.setdefault(index_of[id(seg.param)], []).append((seg.param_start, seg.length, tensors))
        for p in _shard_params(zero, shard):
            scalars[index_of[id(p)]] = {k: _clone(v) for k, v in st.items() if not _is_sharded(v, shard)}
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
    zero._load((pieces, scalars), shards[0]["param_groups"])
