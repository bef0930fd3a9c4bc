"""The older bucket rule the simulator's checked tables were made with: a bucket closes *before* its cap.

MiniDDP and torch's DDP close a bucket *after* the tensor that reaches its
cap (:func:`minddp.ddp.core.assignment.assign_buckets`: a bucket passes its
cap by at most one tensor). The simulator's published comparisons
(``docs/simulator_checked.md``) were fitted with buckets that never pass the
cap, so :class:`~minddp_lab.simulate.replay.DDPPolicy` keeps that rule by
default (``buckets_may_pass_cap=False``); the bucket planner replays with
torch's.
"""

from __future__ import annotations

from typing import Sequence

from minddp.ddp.core.assignment import TensorSpec, size_limits

__all__ = ["buckets_within_cap"]


def buckets_within_cap(specs: Sequence[TensorSpec], cap_bytes: int,
                       first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group tensor indices into buckets of one (dtype, device) each that never pass their limit
    (:func:`~minddp.ddp.core.assignment.size_limits`), unless one tensor alone does: the older rule."""
    if cap_bytes < 0:
        raise ValueError(f"bucket cap must be >= 0 bytes (0: one tensor per bucket), got {cap_bytes}")
    limits = size_limits(cap_bytes, first_cap_bytes)
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_per_key: dict[tuple, int] = {}
    closed: list[list[int]] = []
    for index, spec in enumerate(specs):
        key = (spec.dtype, spec.device)
        limit = limits[min(closed_per_key.get(key, 0), len(limits) - 1)]
        if open_buckets.get(key) and open_bytes[key] + spec.nbytes > limit:
            closed.append(open_buckets.pop(key))
            open_bytes[key] = 0
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + spec.nbytes
    return closed + list(open_buckets.values())
