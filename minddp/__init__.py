"""minddp: a readable DistributedDataParallel, built from scratch.

Read in this order: ``minddp/ddp/core/`` (the plain path of a gradient: hook,
bucket, in-order all-reduce, end-of-backward wait, .grad; it imports nothing
else of minddp) -> ``minddp/ddp/wrapper.py`` (the wrapper: construction,
forward, no_sync). Every option beyond that path is a part in
``minddp/ddp/parts/``, one file each, picked by MiniDDP's constructor
(``docs/reading_the_code.md`` lists them).
"""

from minddp.ddp.compiled import compile  # torch.compile, cut at MiniDDP's buckets (minddp/ddp/compiled.py)
from minddp.ddp.wrapper import MiniDDP
from minddp.launch import distributed, init_distributed, spawn
from minddp.sampler import DistributedSampler
from minddp.sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedSampler", "MiniDDP", "SyncBatchNorm", "distributed", "init_distributed", "spawn"]
__version__ = "0.1.0"
