"""ZeRO stages 1 and 2 (Rajbhandari et al., 2020) on MiniDDP: shard what DDP replicates.

Read in this order: :mod:`minddp.zero.partition` (who owns which elements of
a flat buffer) -> :mod:`minddp.zero.shards` (a rank's elements, end to end,
and the maps back to the parameters) -> :mod:`minddp.zero.sharded_gradients`
(a round's averaged gradients in the shards) -> :mod:`minddp.zero.presence` (which
parameters a step moves) -> :mod:`minddp.zero.optimizer`
(``ZeroRedundancyOptimizer``: stage 1) -> :mod:`minddp.zero.stage2` (gradient
sharding: MiniDDP reduce-scatters its buckets) -> :mod:`minddp.zero.collectives`
-> :mod:`minddp.zero.checkpoint` -> :mod:`minddp.zero.memory` (bytes per rank,
measured and as the paper's formulas).

The core (``minddp/*.py``) never imports this package; stage 2 reaches the
reducer through a comm hook and lent buckets (:mod:`minddp.ddp.parts.lent_buckets`).
"""

from minddp.zero.checkpoint import load_sharded, save_sharded
from minddp.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "load_sharded", "save_sharded"]
