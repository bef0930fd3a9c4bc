"""torch's flat all-gather and reduce-scatter, under their newest names, on every torch minddp supports.

torch 2.14 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and
``reduce_scatter_tensor`` to ``reduce_scatter_single`` (the old names warn).
ZeRO (:mod:`minddp.zero.collectives`, :mod:`minddp.zero.stage2`) and FSDP
(:mod:`minddp.fsdp.collectives`) call them from here.

[Note: bound at import] Each name is looked up on ``torch.distributed`` once,
when this module is first imported (by the first of ``minddp.zero`` and
``minddp.fsdp`` imported). So a wrapper someone installed on
``torch.distributed`` before that (lesson 20's byte counter, lesson 22's
simulated link) is the one called; one installed later is not seen.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
