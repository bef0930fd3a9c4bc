"""ZeRO's step-time collectives (minddp/zero/collectives.py) on Gloo: no hidden copy of what they send.

Torch's Gloo ``reduce_scatter_tensor`` clones its whole input and all-reduces
the clone; on Gloo these collectives are sends and receives instead
(:mod:`minddp.zero.pairwise`). Counted by torch's profiler from the allocator
(:func:`minddp.zero.memory.allocation_peak`): what a call allocates and frees
again, against the temporaries it needs by design: the unit laid end to end
(what is sent, or gathered), this rank's piece (received, or sent), and for
the reduce-scatter one rank's chunk being read into the unit.
"""

import torch
from torch import nn

from minddp.zero import ZeroRedundancyOptimizer
from minddp.zero.collectives import all_gather_params, reduce_scatter_grads
from minddp.zero.memory import allocation_peak
from minddp.zero.shards import Shard

WIDTH = 512
SLACK = 64 * 1024  # bookkeeping, far below a copy of the 2 MiB sent


def _transients(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)  # no wrapper: it averages
    model(torch.randn(4, WIDTH)).square().mean().backward()
    layout, group = opt.layout, opt.process_group
    for shard in layout.shards:
        shard.gradient()  # allocated before the measure: only temporaries count
    scatter_peak, scatter_kept = allocation_peak(
        lambda: reduce_scatter_grads(layout, lambda p: p.grad, Shard.gradient, group, world_size))
    gather_peak, gather_kept = allocation_peak(
        lambda: all_gather_params(layout, lambda s: s.master, lambda p: p.data, group))
    sent = max(world_size * unit.piece for unit in layout.units) * 4
    return scatter_peak - scatter_kept, gather_peak - gather_kept, sent


def test_step_collectives_allocate_what_they_send_once(ranks):
    for scatter, gather, sent in ranks(2).run(_transients, timeout_s=60):
        piece = sent // 2
        assert scatter <= sent + 2 * piece + SLACK, f"reduce-scatter: {scatter / 2**20:.2f} MiB for a while, " \
                                        f"{sent / 2**20:.2f} MiB sent"
        assert gather <= sent + piece + SLACK, f"all-gather: {gather / 2**20:.2f} MiB for a while, {sent / 2**20:.2f} MiB"
