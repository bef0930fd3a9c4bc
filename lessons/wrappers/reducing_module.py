"""The module side of lesson 07c's reducers: rank 0's start everywhere, and a forward that arms the reducer.

From lesson 07c on, the chain grows the gradient's path alone, as a reducer
class (``counted_reducer.py`` ... and last ``minddp/ddp/core/reducer.py``),
and this wrapper stays as it is: what ``FlatDDP`` did besides the gradients,
split off the way ``minddp.MiniDDP`` (the module) is split from its reducer.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from minddp.ddp.core.reducer import ReducerOptions


class ReducingModule(nn.Module):
    """``module`` with rank 0's parameters and buffers, whose synchronized backwards ``reducer_class`` averages."""

    def __init__(self, module: nn.Module, reducer_class, bucket_cap_bytes: float):
        super().__init__()
        self.module = module
        self.require_sync = True  # False while accumulating micro-batches
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        options = ReducerOptions(bucket_cap_mb=bucket_cap_bytes / 2**20, learn_bucket_order=False)
        self.reducer = reducer_class([p for _, p in named], [name for name, _ in named], dist.group.WORLD, options)

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        if self.require_sync and torch.is_grad_enabled():
            self.reducer.prepare_for_backward(output)  # this forward's backward averages
        return output

    def bucket_names(self) -> list:
        return [list(bucket.names) for bucket in self.reducer.buckets]
