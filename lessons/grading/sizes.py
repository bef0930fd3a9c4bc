"""Grade at several world sizes on one pool of ranks: the first k ranks' own group stands in for the world.

Starting ranks costs seconds each, so the grader keeps one pool (of 4) and,
for a world size k, makes a process group of ranks 0 .. k-1 the *default*
group while the check runs: ``dist.get_world_size()`` is k, every
collective called without a ``group`` goes to those k ranks, and a rank's
number is the same in both (rank r of the pool is rank r of the group).
The ranks from k on sit the check out.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_GROUPS: dict[int, object] = {}  # k -> the group of ranks 0 .. k-1, made once per rank process


def prepare(sizes, timeout_s: float) -> None:
    """Make the groups (every rank of the pool, in the same order: ``new_group`` is itself a collective)."""
    for k in sorted(set(sizes)):
        if k not in _GROUPS and k <= dist.get_world_size():
            _GROUPS[k] = dist.new_group(list(range(k)), timeout=timedelta(seconds=timeout_s))


@contextlib.contextmanager
def world_of(k: int):
    """While inside, the default process group is ranks 0 .. k-1 (this rank must be one of them)."""
    world = c10d._world.default_pg
    c10d._world.default_pg = _GROUPS[k]
    try:
        yield
    finally:
        c10d._world.default_pg = world
