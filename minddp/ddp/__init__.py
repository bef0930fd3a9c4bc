"""The DDP core: ``MiniDDP`` and everything one step of it runs.

Read in this order: :mod:`~minddp.ddp.wrapper` (``MiniDDP``: construction,
forward, ``no_sync``) -> :mod:`~minddp.ddp.reducer` (the plain path of a
gradient: hook, bucket, in-order all-reduce, end-of-backward wait, ``.grad``)
-> :mod:`~minddp.ddp.buckets` (flat buckets and their life cycle). Every
option beyond that path is a part in :mod:`minddp.ddp.parts`, one file each,
picked by ``MiniDDP``'s constructor. The rest of this package is what the
wrapper stands on: where the module lives (:mod:`~minddp.ddp.placement`),
making replicas identical (:mod:`~minddp.ddp.broadcast`,
:mod:`~minddp.ddp.replicas`), uneven inputs (:mod:`~minddp.ddp.join`),
torch's communication hooks (:mod:`~minddp.ddp.default_hooks`), the words of
its errors (:mod:`~minddp.ddp.messages`) and the
methods torch's DDP and its reducer offer to frameworks
(:mod:`~minddp.ddp.torch_ddp_calls`, :mod:`~minddp.ddp.torch_reducer_calls`).
"""

from minddp.ddp.wrapper import MiniDDP

__all__ = ["MiniDDP"]
