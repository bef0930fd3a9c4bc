"""The DDP core: ``MiniDDP`` and everything one step of it runs.

Read in this order: :mod:`~minddp.ddp.wrapper` (``MiniDDP``: construction,
forward, ``no_sync``, and the methods torch's DDP offers to frameworks) ->
:mod:`~minddp.ddp.core.reducer` (the plain path of a gradient: hook, bucket,
in-order all-reduce, end-of-backward wait, ``.grad``) ->
:mod:`~minddp.ddp.core.slots` (what the reducer asks of each slot, its
backward's phase, the interface for policies) -> :mod:`~minddp.ddp.core.buckets`
(flat buckets and their life cycle). Every option beyond that path is a part
in :mod:`minddp.ddp.parts`, one file each, picked by ``MiniDDP``'s
constructor; what only watches is in :mod:`minddp.ddp.observers`. The rest
of this package is what the wrapper stands on: where the module lives
(:mod:`~minddp.ddp.placement`), making replicas identical
(:mod:`~minddp.ddp.broadcast`, :mod:`~minddp.ddp.replicas`), torch's
communication hooks (:mod:`~minddp.ddp.default_hooks`) and the words of its
errors (:mod:`~minddp.ddp.core.messages`).
"""

from minddp.ddp.wrapper import MiniDDP

__all__ = ["MiniDDP"]
