"""Fully sharded data parallel (ZeRO stage 3) with torch FSDP2's API, on flat units.

    from minddp.fsdp import fully_shard, MixedPrecisionPolicy, full_state_dict

Read in this order: :mod:`minddp.fsdp.policy` (dtypes) -> :mod:`minddp.fsdp.unit`
(one unit's flat shard, gathered and freed, its gradient reduce-scattered)
-> :mod:`minddp.fsdp.schedule` (when: forward, backward, prefetch, the end
of backward) -> :mod:`minddp.fsdp.fully_shard` (the API: which parameters
make a unit, the hooks) -> :mod:`minddp.fsdp.state_dict` -> :mod:`minddp.fsdp.checks`.
"""

from minddp.fsdp.fully_shard import FSDPModule, fully_shard
from minddp.fsdp.policy import MixedPrecisionPolicy
from minddp.fsdp.state_dict import full_state_dict, load_full_state_dict

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard", "full_state_dict", "load_full_state_dict"]
