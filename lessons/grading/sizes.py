"""Grade at several world sizes on one pool of ranks: the first k ranks' own group stands in for the world.

Starting ranks costs seconds each, so the grader keeps one pool (of 4) and,
for a world size k, makes a process group of ranks 0 .. k-1 the *default*
group while the check runs: ``dist.get_world_size()`` is k, every
collective called without a ``group`` goes to those k ranks, and a rank's
number is the same in both (rank r of the pool is rank r of the group).
The ranks from k on sit the check out.

At 4 ranks an exercise that takes a ``group`` is also given one of two
groups of 2 (``pair_of``): ranks 0 and 2, ranks 1 and 3. Their numbers
inside the group differ from the world's (rank 2 is rank 1 of its pair), so
code that mixes the two is caught.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_GROUPS: dict[int, object] = {}  # k -> the group of ranks 0 .. k-1, made once per rank process
PAIRS = ([0, 2], [1, 3])  # the groups given at 4 ranks
_PAIRS: list = []  # their process groups, made once per rank process
_current = [0]  # the world size of the check running now


def prepare(sizes, timeout_s: float, remake=()) -> None:
    """Make the groups (every rank of the pool, in the same order: ``new_group`` is itself a collective).

    ``remake``: the world sizes whose groups a failed check may have left messages in (a ``send`` nobody
    received, say): they get new groups, so that the next check's ``recv`` never takes a message of the last.
    """
    for k in sorted(set(sizes) | set(remake)):
        if (k not in _GROUPS or k in remake) and k <= dist.get_world_size():
            _GROUPS[k] = dist.new_group(list(range(k)), timeout=timedelta(seconds=timeout_s))
    if 4 in sizes and (not _PAIRS or 4 in remake) and dist.get_world_size() >= 4:
        _PAIRS[:] = [dist.new_group(ranks, timeout=timedelta(seconds=timeout_s)) for ranks in PAIRS]


def pair_of(rank: int):
    """The group of 2 that ``rank`` belongs to, while a world of 4 is graded; else None."""
    if _current[0] != 4 or not _PAIRS:
        return None
    return next(group for group, ranks in zip(_PAIRS, PAIRS) if rank in ranks)


@contextlib.contextmanager
def world_of(k: int):
    """While inside, the default process group is ranks 0 .. k-1 (this rank must be one of them)."""
    world, outer = c10d._world.default_pg, _current[0]
    c10d._world.default_pg, _current[0] = _GROUPS[k], k
    try:
        yield
    finally:
        c10d._world.default_pg, _current[0] = world, outer
