"""MiniDDP under ``join()``: ranks with fewer batches shadow the others' steps (torch's ``_DDPJoinHook``).

The generic mechanism (who is still training, the loop that shadows) is
:mod:`minddp.ddp.join`; this is MiniDDP's part in it, :class:`MiniDDPJoinHook`,
made when a ``Join`` (minddp's or torch's) asks the model for its join hook
(``MiniDDP.join_hook``), and from then on a forward-time part of the model:

* at each synchronized forward (:meth:`MiniDDPJoinHook.before_forward`):
  tell the join context this rank trains, and learn who else does; divide
  gradients by the initial world size (torch's default) or by the ranks
  still active; take buffers from the last rank still training, at every
  synchronized forward (a joined rank shadows each one with a broadcast,
  not knowing what the others' previous forward was);
* on a rank that ran out of data, for each step the others still take
  (:meth:`~MiniDDPJoinHook.main_hook`): the same collectives in the same
  order, with nothing to contribute: the buffer broadcast, every bucket's
  all-reduce (of zeros, ``Reducer.shadow_backward``), the unused-parameter
  search if there is one;
* when everyone is done: the last rank to train broadcasts its parameters
  and buffers.
"""

from __future__ import annotations

from minddp.ddp.join import Join, JoinHook, under_torchs_join
from minddp.ddp.broadcast import broadcast_coalesced, sync_buffers

__all__ = ["MiniDDPJoinHook"]


class MiniDDPJoinHook(JoinHook):
    """MiniDDP's part in :class:`~minddp.ddp.join.Join`: count who trains, shadow the others' steps, then agree."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        if ddp.buffer_sync == "average":
            raise ValueError(
                "join() needs buffer_sync='broadcast' or 'off': a rank that has run out of data "
                "would pull the averaged buffers towards its stale ones"
            )
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def divisor(self, active) -> int:
        """Gradients are divided by the initial world size (torch's default) or by the active ranks."""
        return len(active) if self.divide_by_initial_world_size else sum(active)

    def before_forward(self, buffers_from: int | None) -> int | None:
        """Before a synchronized forward: who trains? Returns the rank whose buffers everyone takes now."""
        ddp = self.ddp
        ddp.reducer.average_over(ddp.world_size)
        if ddp.join_context is None and under_torchs_join(ddp):  # Join([model, ...]) of torch's
            if not ddp._join_config.is_first_joinable:  # its steps open with MiniDDP's collectives
                raise ValueError("under torch's Join, MiniDDP must be the first joinable: Join([model, optimizer])")
            ddp.join_context = Join.inside_torchs_join(ddp)
        active = Join.notify_join_context(ddp)  # inside join(): who is still training?
        if active is None:
            return buffers_from
        ddp.reducer.average_over(self.divisor(active))
        if ddp.buffer_policy is None:
            return buffers_from  # (last_active reads the answer back: a wait for the GPU, only where used)
        return ddp.join_context.last_active

    def main_hook(self) -> None:
        join = self._join()
        if join.inside_torch:  # torch's loop answers only its own all-reduce; the exchange is answered here
            join._exchange(active=False)
        ddp = self.ddp
        if ddp.world_size > 1:
            sync_buffers(ddp._module_buffers(), ddp.process_group, ddp.buffer_sync, join.last_active)
        ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        # Everyone is done: the last rank to train has the newest parameters.
        ddp = self.ddp
        buffers = ddp._module_buffers() if ddp.buffer_sync != "off" else []  # torch: forward_sync_buffers
        broadcast_coalesced(ddp._module_parameters() + buffers, ddp.process_group, self._join().last_active)
        ddp.reducer.average_over(ddp.world_size)

    def _join(self) -> Join:
        """Who trains, and who trained last: minddp's Join knows (see ``Join.inside_torchs_join``)."""
        if self.ddp.join_context is None:  # under torch's Join, a rank that never trained in it
            self.ddp.join_context = Join.inside_torchs_join(self.ddp)
        return self.ddp.join_context

