"""Stage 1 on MiniDDP: take this rank's part of each bucket as its all-reduce arrives.

Stage 1 could simply read the averaged ``.grad`` at ``step()``; it does so on
torch's DDP. On MiniDDP it registers this comm hook instead, which
all-reduces each bucket exactly as MiniDDP would (each gradient times 1/N,
then the sum: the same bits) and copies the elements this rank owns into
its shards when the sum arrives. The reducer still writes ``.grad`` as
usual, so nothing changes for the user. Why bother: under ``join()``, a rank
out of data never writes ``.grad`` (it all-reduces zeros in place of a
backward), but this hook runs on that path too, so the rank still gets the
others' average for the shard it must step and send.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minddp.ddp.default_hooks import GradBucket
from minddp.zero.collectives import WorkFuture

__all__ = ["attach_allreduce"]


def attach_allreduce(zero, ddp) -> bool:
    """Register the hook on ``ddp`` (a MiniDDP without a comm hook); False where it cannot."""
    reducer = getattr(ddp, "reducer", None)
    # torch's DDP has a reducer too (its C++ one, without a communication part).
    communication = getattr(reducer, "communication", None)
    if communication is None or communication.comm_hook is not None or not hasattr(ddp, "register_comm_hook"):
        return False  # torch's DDP, or a hook already there: the optimizer reads .grad at step()
    ddp.register_comm_hook(zero, allreduce_into_shards_hook)
    return True


def allreduce_into_shards_hook(zero, bucket: GradBucket) -> torch.futures.Future:
    """Comm hook: average the bucket over the ranks; this rank's elements into ``zero``'s shards."""
    buffer = bucket.buffer().mul_(1.0 / zero.ddp.reducer.divisor)
    work = dist.all_reduce(buffer, group=zero.process_group, async_op=True) if zero.world_size > 1 else None
    params, views = bucket.parameters(), bucket.gradients()

    def arrived() -> None:
        zero.grads.begin_round()
        for p, view in zip(params, views):  # the bucket holds .grad's sum: a copy, not an addition
            zero.grads.fill_param(p, view)

    return WorkFuture(work, buffer, arrived)
