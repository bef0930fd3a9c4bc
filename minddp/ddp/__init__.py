"""DDP: ``MiniDDP`` and everything one step of it runs.

Read in this order: :mod:`minddp.ddp.core` (the plain path of a gradient:
the reducer, its slots, the buckets; it imports nothing else of minddp) ->
:mod:`~minddp.ddp.wrapper` (``MiniDDP``: construction, forward, ``no_sync``).
What is asked of a built model is :mod:`~minddp.ddp.later_options`; torch's
names beyond its documented API, :mod:`~minddp.ddp.torch_surface`. Every
option beyond the plain path is a part in :mod:`minddp.ddp.parts`, one file
each, picked by ``MiniDDP``'s constructor; what only watches is in
:mod:`minddp.ddp.observers`, what acts between backwards (the learned bucket
order) in :mod:`~minddp.ddp.policies`. The rest of this package is what the
wrapper stands on: where the module lives (:mod:`~minddp.ddp.placement`),
making replicas identical (:mod:`~minddp.ddp.broadcast`,
:mod:`~minddp.ddp.replicas`) and torch's communication hooks
(:mod:`~minddp.ddp.default_hooks`).
"""

from minddp.ddp.wrapper import MiniDDP

__all__ = ["MiniDDP"]
