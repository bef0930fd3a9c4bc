"""Exercise 21: fully sharded -- gather a unit, compute, free it (lesson 21).

``Unit`` is written for you: this rank keeps one flat piece of a layer's
parameters (``unit.shard``), ``unit.gather()`` all-gathers the full flat
parameters, ``unit.run(full, x)`` computes the layer with them, and
``free(tensor)`` gives a tensor's memory back at once. Write the forward and
backward of ``GatherComputeFree``; then, from the repository's root:

    python -m lessons.grade 21

The grader trains a model of 4 units for 3 SGD steps on 3 ranks (then 2, 4 and 1) and compares
with one process on the whole batch; it also notes the bytes of every
gathered tensor still alive each time a unit is gathered, and checks that
backward gathers every unit again.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def free(tensor: torch.Tensor) -> None:
    """Give the tensor's bytes back now, whoever still holds a reference to it."""
    tensor.untyped_storage().resize_(0)


class Unit:
    """One layer, sharded: this rank's flat piece of its parameters, padded to N equal pieces."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.shapes = {name: p.shape for name, p in layer.named_parameters()}
        flat = torch.cat([p.detach().reshape(-1) for p in layer.parameters()])
        self.numel, self.piece = flat.numel(), -(-flat.numel() // self.world_size)
        padded = nn.functional.pad(flat, (0, self.piece * self.world_size - self.numel))
        self.shard = nn.Parameter(padded[self.rank * self.piece:(self.rank + 1) * self.piece].clone())
        self.gathered = []  # every tensor gather() made (the grader reads it)
        layer.to("meta")  # the full parameters are gone: only the shard is left

    def gather(self) -> torch.Tensor:
        """Every rank's piece, end to end: the full flat parameters (padding included). Free it when done."""
        full = torch.empty(self.piece * self.world_size)
        all_gather(full, self.shard.detach())
        self.gathered.append(full)
        return full

    def run(self, full: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``x``, computed with the parameters in ``full``."""
        params, offset = {}, 0
        for name, shape in self.shapes.items():
            params[name] = full[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return functional_call(self.layer, params, (x,))


class GatherComputeFree(torch.autograd.Function):
    """``GatherComputeFree.apply(x, unit.shard, unit)``: one unit's forward, its full parameters alive only inside."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, unit: Unit) -> torch.Tensor:
        """Gather the unit, compute its output for ``x``, free the full parameters, return the output.

        Save what backward needs -- but not the full parameters: keeping them
        until backward would hold every unit in full at once. When a unit is
        gathered, no other unit's full parameters or full gradient may be
        alive anywhere in the process (the grader follows every tensor made).
        """
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        """Return (gradient for x, gradient for this rank's shard, None).

        Gather the unit again, recompute its output with gradients enabled
        (``torch.enable_grad()``) to get both gradients, reduce-scatter the
        full gradient so that this rank gets the *average* over the ranks of
        its own piece, and free what you gathered.
        """
        raise NotImplementedError


class Sharded(nn.Module):
    """A stack of layers, each its own unit; the optimizer steps the shards."""

    def __init__(self, layers: nn.Sequential):
        super().__init__()
        self.units = [Unit(layer) for layer in layers]
        self.shards = nn.ParameterList([u.shard for u in self.units])

    def forward(self, x):
        for unit in self.units:
            x = GatherComputeFree.apply(x, unit.shard, unit)
        return x
