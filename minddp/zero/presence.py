"""Which parameters a sharded step moves: those that had a gradient this round.

torch's rule, in ``torch.optim`` and torch's ZeRO alike: a parameter whose
gradient is ``None`` (frozen for the step, or not used by the forward) is
not stepped, and its ``step`` count does not advance; a zero gradient is a
step. A flat shard has lost the ``None`` (its gradient buffer holds zeros
there), so the optimizer asks here, per parameter, before each step, and
gives the local optimizer's view of each segment a gradient or ``None``
(:meth:`minddp.zero.shards.Shard.attach_gradients`).

Where the answer comes from depends on where the gradient went:

* through MiniDDP's buckets (a comm hook): ``.grad`` is not where it went
  (stage 2 drops it), so the reducer says: with ``find_unused_parameters``,
  used on some rank in the last synchronized backward; otherwise every
  bucketed parameter had one (a missing one is MiniDDP's error);
* the parameters MiniDDP does not reduce (frozen when it was built), and
  every parameter otherwise: their ``.grad``. Without a wrapper the
  optimizer averages, so every owner must agree: a parameter is stepped if
  any rank has a gradient for it (one small all-reduce of flags).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["outside_wrapper", "stepped_parameters"]


def stepped_parameters(zero, shadow: bool) -> set[int]:
    """ids of ``zero``'s parameters to step this round (``shadow``: a joined rank's stand-in step)."""
    if zero.grads.from_hook:
        reducer = zero.ddp.reducer
        # Stage 2 drops .grad bucket by bucket, noting what was used (summed over backwards); a joined
        # rank's shadow backward writes nothing, and the reducer's last record is the others' answer.
        stepped = set(zero.grads.used) if zero.shard_gradients and not shadow else _used_by(reducer)
        return stepped | {id(p) for p in outside_wrapper(zero) if p.grad is not None}
    params = zero.layout.params
    has = [p.grad is not None and not (shadow and zero.average_gradients) for p in params]
    if zero.average_gradients and zero.world_size > 1:
        flags = torch.tensor(has, dtype=torch.int32, device=zero.join_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=zero.process_group)
        has = [bool(f) for f in flags.tolist()]
    return {id(p) for p, h in zip(params, has) if h}


def outside_wrapper(zero) -> list[torch.Tensor]:
    """``zero``'s parameters the wrapper's buckets do not hold: their ``.grad`` is read at ``step`` (not averaged)."""
    inside = {id(p) for b in zero.ddp.reducer.buckets for p in b.params}
    return [p for p in zero.layout.params if id(p) not in inside]


def _used_by(reducer) -> set[int]:
    """ids of the reducer's parameters that had a gradient on some rank in its last synchronized backward."""
    used = reducer.readiness.used_on_some_rank
    return {id(p) for i, p in enumerate(reducer.params) if used is None or used[i]}
