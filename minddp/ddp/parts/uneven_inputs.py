"""MiniDDP under ``join()``: ranks with fewer batches shadow the others' steps (torch's ``_DDPJoinHook``).

Every synchronized step issues the same collectives on every rank. If rank 1
has 3 batches and rank 0 has 5, rank 0's fourth backward waits forever for a
partner. Dropping data to make shards even throws samples away; ``join``
keeps them::

    with model.join():                    # or torch's Join([model, optimizer])
        for batch in my_batches:          # a different count per rank
            loss_fn(model(batch)).backward()
            optimizer.step()

The mechanism is torch's (``torch.distributed.algorithms.join``), and
MiniDDP is a ``Joinable`` in it, as torch's DDP is: at each step the first
joinable notifies the join context (one all-reduce: how many ranks still
train), and a rank that left its loop answers that all-reduce and runs
each joinable's ``JoinHook.main_hook``, which issues the collectives of a
real step with nothing to contribute; when no rank trains any more, each
``post_hook`` runs once. This is MiniDDP's hook, :class:`MiniDDPJoinHook`,
made when a ``Join`` asks the model for it (``MiniDDP.join_hook``), and from
then on a forward-time part of the model:

* at each synchronized forward (:meth:`MiniDDPJoinHook.before_forward`):
  notify the join context, which counts the ranks still training; divide
  gradients by the initial world size (torch's default) or by that count;
  take buffers from the highest rank still training (one more small
  all-reduce, as torch's ``_find_common_rank``), at every synchronized
  forward (a joined rank shadows each one with that all-reduce and a
  broadcast, not knowing what the others' previous forward was);
* on a rank that ran out of data, for each step the others still take
  (:meth:`~MiniDDPJoinHook.main_hook`): the same collectives in the same
  order: the buffers' source and broadcast, every bucket's all-reduce (of
  zeros, :func:`shadow_backward`), the unused-parameter search if there
  is one;
* when everyone is done: the highest of the last ranks to train broadcasts
  its parameters and buffers.

MiniDDP's collectives open each step, so it must be the first joinable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from minddp.ddp.broadcast import broadcast_coalesced, sync_buffers

__all__ = ["MiniDDPJoinHook", "common_rank", "shadow_backward"]


class MiniDDPJoinHook(JoinHook):
    """MiniDDP's part in torch's ``Join``: count who trains, shadow the others' steps, then agree."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        if ddp.buffer_sync == "average":
            raise ValueError(
                "join() needs buffer_sync='broadcast' or 'off': a rank that has run out of data "
                "would pull the averaged buffers towards its stale ones"
            )
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self._work: dist.Work | None = None  # this step's count of the ranks still training (None: not joined)
        self._active: int | None = None  # ... read back, once asked for

    def before_forward(self, buffers_from: int | None) -> int | None:
        """Before a synchronized forward: notify the join context. Returns the rank whose buffers everyone
        takes now."""
        ddp = self.ddp
        ddp.reducer.average_over(ddp.world_size)
        self._work, self._active = Join.notify_join_context(ddp), None
        if not ddp._join_config.enable:
            return buffers_from  # outside every Join
        if self._work is None:  # an enabled Join notifies through its first joinable only
            raise ValueError("under join, MiniDDP must be the first joinable: Join([model, optimizer])")
        if not self.divide_by_initial_world_size:
            ddp.reducer.average_over(self.ranks_training())
        if ddp.buffer_policy is None:
            return buffers_from
        return common_rank(ddp.process_group, ddp.device, is_candidate=True)

    def ranks_training(self) -> int:
        """How many ranks train this step (the world outside ``join``). A wait for the count's all-reduce
        (on a GPU, for the device), so read only where it is used."""
        if self._work is None:
            return self.ddp.world_size
        if self._active is None:
            self._work.wait()
            self._active = int(self._work.result()[0].item())
        return self._active

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp.buffer_policy is not None:
            source = common_rank(ddp.process_group, ddp.device, is_candidate=False)
            sync_buffers(ddp.module_buffers(), ddp.process_group, ddp.buffer_sync, source)
        shadow_backward(ddp.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        # Everyone is done: the last ranks to train have the newest parameters.
        ddp = self.ddp
        source = common_rank(ddp.process_group, ddp.device, is_candidate=is_last_joiner)
        buffers = ddp.module_buffers() if ddp.buffer_sync != "off" else []  # torch: forward_sync_buffers
        broadcast_coalesced(ddp.module_parameters() + buffers, ddp.process_group, source)
        ddp.reducer.average_over(ddp.world_size)
        self._work = self._active = None


def common_rank(group: dist.ProcessGroup, device: torch.device, is_candidate: bool) -> int:
    """The highest group rank among the candidates, on every rank (one all-reduce; torch's DDP's
    ``_find_common_rank``)."""
    rank = torch.tensor([dist.get_rank(group) if is_candidate else -1], device=device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=group)
    return int(rank.item())


def shadow_backward(reducer) -> None:
    """A joined rank's stand-in for a backward: the same collectives as the other ranks', in the same
    order, contributing zeros (every bucket's all-reduce, then the readiness part's own: the search for
    unused parameters), then the end of a backward as the others see it (the policies' turn)."""
    reducer.rebuild_if_due()  # the others rebuild at their forward: the same buckets everywhere
    reducer.observer.backward_started()  # nothing will arrive here; the step still counts, as on the other ranks
    for bucket in reducer.buckets:
        bucket.acquire()
        bucket.buffer.zero_()
        bucket.launch_unconditionally(reducer.communication.communicate)
        bucket.wait()
        bucket.reset()
        if not reducer.storage.keep_buffers:
            bucket.release()
    reducer.readiness.shadow_backward(reducer)
    reducer.observer.after_backward()
