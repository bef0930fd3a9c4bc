"""What is asked of a built MiniDDP: a comm hook, ``join()``, the buffers' switch, following a gradient.

Each swaps or adds a part of the reducer (:mod:`minddp.ddp.parts`), or an
observer; none is on the plain path of a gradient. ``MiniDDP`` inherits
these methods; they use its attributes (``reducer``, ``process_group``, the
buffer policy), set by its constructor.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from minddp.ddp.broadcast import BufferSync
from minddp.ddp.default_hooks import check_comm_hook
from minddp.ddp.observers.follow import FollowedGradient, follow
from minddp.ddp.observers.trace import StepTimeline, Tracer
from minddp.ddp.parts.buffers_in_bucket import RidesInLastBucket
from minddp.ddp.parts.comm_hook import CommHook
from minddp.ddp.parts.uneven_inputs import MiniDDPJoinHook

__all__ = ["LaterOptions"]


class LaterOptions:
    """``MiniDDP``'s methods for what is asked after construction (and what they let you read back)."""

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]`` (the communication
        part :class:`~minddp.ddp.parts.comm_hook.CommHook`). torch's contract: once, before the first backward;
        the hook does the averaging (MiniDDP no longer divides by the world size for it)."""
        if self.reducer.communication.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self.reducer.backwards_done or self.reducer.phase.in_backward:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        check_comm_hook(hook)
        self.reducer.set_communication(CommHook(self.reducer, state, hook))
        self._buffers_by_broadcast()  # a hook need not be a sum: buffers go back to their broadcast

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with model.join():`` lets ranks with fewer batches finish early: torch's ``Join([self])``
        (:mod:`minddp.ddp.parts.uneven_inputs`); ``throw_on_early_termination=True``: every rank
        raises as soon as one has run out instead."""
        return Join([self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, divide_by_initial_world_size: bool = True) -> MiniDDPJoinHook:
        """What the model does for a ``Join`` once its rank has run out of data
        (torch's ``Joinable`` contract); from then on a part of its forward too."""
        self._join_hook = MiniDDPJoinHook(self, divide_by_initial_world_size)
        self._buffers_by_broadcast()  # inside join, every synchronized forward broadcasts
        return self._join_hook

    @property
    def join_device(self) -> torch.device:
        """Where a ``Join``'s count lives (torch's ``Joinable`` contract)."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The ranks a ``Join`` counts over (torch's ``Joinable`` contract)."""
        return self.process_group

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether a synchronized forward brings the buffers into line (torch's name; ``broadcast_buffers`` too)."""
        return self._forward_sync_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        """Set on a built model, as frameworks do: it rules from the next forward on, as torch's DDP reads its
        flag at every forward. Switched on again, the kind asked at construction comes back (``average`` stays
        ``average``); buffers that rode in the last bucket (``with_gradients``) come by broadcast."""
        self._forward_sync_buffers = bool(value)
        if not value:
            self._buffers_by_broadcast()
            self.buffer_sync, self.buffer_policy = "off", None
        elif self.buffer_sync == "off":
            asked = self._buffer_sync_asked
            self.buffer_sync = asked if asked in ("broadcast", "average") else "broadcast"
            if self.world_size > 1 and self.module_buffers():
                self.buffer_policy = BufferSync(self.module_buffers, self.process_group, self.buffer_sync)

    broadcast_buffers = forward_sync_buffers  # torch's older name for the same flag

    def _buffers_by_broadcast(self) -> None:
        """Buffers no longer ride in the last bucket (``buffer_sync="with_gradients"``): a broadcast again."""
        riding = self.reducer.gradients
        if isinstance(riding, RidesInLastBucket):
            self.reducer.set_gradients(riding.inner)
            self.reducer.build_again()  # without the room
            self.buffer_policy = BufferSync(self.module_buffers, self.process_group, "broadcast")

    def follow(self, name: str) -> FollowedGradient:
        """Follow one parameter's gradient down the path in the next synchronized backwards
        (:mod:`minddp.ddp.observers.follow`): ``print(model.follow("0.weight").report())`` after one."""
        return follow(self.reducer, name)

    # ------------------------------------------------------------- inspection
    @property
    def timeline(self) -> StepTimeline:
        """When things happened in the last synchronized backward (with ``timeline=True`` or ``trace=True``:
        :mod:`minddp.ddp.observers.trace`)."""
        if self._observer is None:
            raise RuntimeError("MiniDDP records no timeline unless asked: construct MiniDDP(..., timeline=True)")
        return self._observer.timeline

    @property
    def tracer(self) -> Tracer | None:
        """The Chrome-trace recorder, with ``trace=True``; None otherwise."""
        return self._observer.tracer if self._observer is not None else None

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for tests and lessons)."""
        return [list(b.names) for b in self.reducer.buckets]
