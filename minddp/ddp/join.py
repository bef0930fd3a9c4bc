"""Uneven inputs: letting ranks that ran out of data finish without hanging the rest.

Every synchronized step issues the same collectives on every rank. If rank 1
has 3 batches and rank 0 has 5, rank 0's fourth backward waits forever for a
partner. Dropping data to make shards even throws samples away; ``join``
keeps them::

    with model.join():
        for batch in my_batches:          # a different count per rank
            loss_fn(model(batch)).backward()
            optimizer.step()

The mechanism is generic, as in torch (``torch.distributed.algorithms.join``),
and knows nothing about DDP:

* at the start of every step each :class:`Joinable` calls
  :meth:`Join.notify_join_context`: one small all-reduce of a 0/1 flag per
  rank tells everyone who is still training. A training rank launches it and
  reads the answer only if it needs it (:class:`Flags`): on a GPU, reading
  it would stall the CPU until the GPU had caught up, every step;
* a rank that left its loop enters :meth:`Join.__exit__` and, for every step
  the others still take, answers that all-reduce with "not me" and runs each
  joinable's :meth:`JoinHook.main_hook`, which issues the same collectives
  as a real step, with nothing to contribute;
* when no rank is active, each :meth:`JoinHook.post_hook` runs once, told
  whether this rank was among the last to join.

The hooks follow torch's ``JoinHook`` contract (``main_hook()``,
``post_hook(is_last_joiner)``), so one hook serves both context managers: a
joinable's hook runs under torch's ``Join`` too. What torch's does not tell
(who is still training, the last rank that trained) a hook reads from
minddp's :class:`Join`, its joinable's ``join_context``.

What a joinable does while shadowing (for MiniDDP: all-reduce zeros in bucket
order, then make the replicas agree) lives with the joinable, behind its
:class:`JoinHook`; see ``MiniDDP.join_hook`` in :mod:`minddp.ddp.wrapper`.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms import join as torch_join

__all__ = ["Join", "JoinHook", "Joinable", "Flags", "under_torchs_join"]


class Flags(Sequence[bool]):
    """``flags[r]``: is rank ``r`` still training? The answer of one all-reduce, read when first looked at.

    Its length is known at once (the group's size); its values need the
    all-reduce done and copied to the CPU, a wait for the device, so they
    are read only when asked for. torch's DDP does the same: a training rank
    hands the work to its reducer and waits for it only where the answer is
    used.
    """

    def __init__(self, flags: torch.Tensor, work: dist.Work | None = None):
        self._flags, self._work = flags, work
        self._values: list[bool] | None = None

    def __len__(self) -> int:
        return self._flags.numel()

    def __getitem__(self, rank):
        if self._values is None:
            if self._work is not None:
                self._work.wait()
            self._values = [bool(f) for f in self._flags.tolist()]
        return self._values[rank]


class JoinHook(torch_join.JoinHook):
    """What one joinable does once its rank has run out of inputs (torch's contract, so torch's ``Join`` runs it)."""

    def main_hook(self) -> None:
        """Shadow one step of the ranks still training."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Once every rank has joined; ``is_last_joiner``: this rank shadowed no step."""


class Joinable(Protocol):
    """An object that takes part in :class:`Join` (MiniDDP is one)."""

    join_context: "Join | None"  # set by Join while inside its ``with`` block
    join_process_group: dist.ProcessGroup
    join_device: torch.device

    def join_hook(self, **kwargs) -> JoinHook: ...


class Join:
    """``with Join([joinable, ...]):`` one block of uneven inputs; ``kwargs`` go to every ``join_hook``."""

    inside_torch = False  # see inside_torchs_join

    def __init__(self, joinables: Iterable[Joinable], enable: bool = True, throw_on_early_termination: bool = False,
                 **kwargs):
        self.joinables = list(joinables)
        if not self.joinables:
            raise ValueError("Join needs at least one joinable")
        self.enable = enable
        # torch's option: instead of shadowing, every rank raises as soon as one has run out of inputs.
        self.throw_on_early_termination = throw_on_early_termination
        self.hooks = [j.join_hook(**kwargs) for j in self.joinables]
        self.group = self.joinables[0].join_process_group
        self.device = self.joinables[0].join_device
        self.active: Sequence[bool] = []  # the last answer that had someone training

    @classmethod
    def inside_torchs_join(cls, joinable: Joinable) -> "Join":
        """minddp's bookkeeping for a joinable that torch's ``Join`` runs.

        torch's ``Join`` runs the loop and the hooks, and counts the ranks
        still training, but tells its hooks neither who they are nor who
        trained last; a joinable that needs to know (MiniDDP: whose buffers,
        which divisor) keeps one of these as its ``join_context``: the same
        exchange, issued by the training ranks at each step and answered by
        the joined rank's ``main_hook``. Never used as a context manager.
        """
        join = cls.__new__(cls)
        join.joinables, join.enable, join.hooks = [joinable], True, []
        join.throw_on_early_termination = False  # torch's Join throws itself
        join.group, join.device, join.active = joinable.join_process_group, joinable.join_device, []
        join.inside_torch = True
        return join

    def __enter__(self) -> "Join":
        if self.enable:
            for joinable in self.joinables:
                joinable.join_context = self
                if hasattr(joinable, "_join_config"):  # left enabled by an earlier torch Join: not this block's
                    joinable._join_config = torch_join._JoinConfig.construct_disabled_join_config()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.enable and exc_type is None:
                self._shadow_until_everyone_joined()
        finally:
            for joinable in self.joinables:
                joinable.join_context = None

    @property
    def last_active(self) -> int:
        """The highest rank still training at the last exchange (its replica is the newest)."""
        return max((r for r, a in enumerate(self.active) if a), default=0)

    @staticmethod
    def notify_join_context(joinable: Joinable) -> list[bool] | None:
        """Called by a joinable at the start of each step; who is still training (None outside ``join``).

        Only the first joinable of a block communicates, so a step costs one
        all-reduce however many joinables there are.
        """
        join = joinable.join_context
        if under_torchs_join(joinable):
            torch_join.Join.notify_join_context(joinable)  # torch's Join counts the steps itself
        if join is None:
            return None
        if joinable is not join.joinables[0]:
            return join.active
        active = join._exchange(active=True)
        if join.throw_on_early_termination and not all(active):
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        return active

    def _exchange(self, active: bool) -> Sequence[bool]:
        # This rank's flag, made on the device: writing a Python number into a GPU tensor waits for the GPU.
        me = torch.arange(dist.get_world_size(self.group), device=self.device) == dist.get_rank(self.group)
        flags = me.to(torch.int32) * int(active)
        if active:  # this rank trains, so the answer has someone training: keep it, unread
            self.active = Flags(flags, dist.all_reduce(flags, group=self.group, async_op=True))
            return self.active
        dist.all_reduce(flags, group=self.group)
        who = Flags(flags)
        if any(who):  # a joined rank reads at once: is there a step to shadow?
            self.active = who
        return who

    def _shadow_until_everyone_joined(self) -> None:
        is_last_joiner = True
        while any(self._exchange(active=False)):
            if self.throw_on_early_termination:  # the others raise at this same exchange
                raise RuntimeError(f"Rank {dist.get_rank(self.group)} exhausted all inputs.")
            is_last_joiner = False
            for hook in self.hooks:
                hook.main_hook()
        for hook in self.hooks:
            hook.post_hook(is_last_joiner)


def under_torchs_join(joinable) -> bool:
    """Has torch's ``Join`` enabled this joinable? (It sets ``_join_config`` and never resets it.)"""
    config = getattr(joinable, "_join_config", None)
    return config is not None and config.enable
