"""The three collectives of ZeRO, over flat units, in bounded chunks.

* :func:`all_gather_params`: after the step, every rank's updated piece of
  every unit back into everyone's parameters (stages 1 and 2);
* :func:`reduce_scatter_grads`: without a DDP wrapper, average the gradients
  and leave each rank only its piece (the paper's stage 1 traffic: a
  reduce-scatter plus an all-gather move what one all-reduce moves);
* :func:`gather_to`: shard-shaped tensors (optimizer state) to one rank,
  shaped like the parameters, for a consolidated checkpoint.

On Gloo the all-gather and the reduce-scatter are sends and receives
(:mod:`minddp.zero.pairwise`: Gloo's reduce-scatter clones its input and
all-reduces it, twice the bytes). The sum's order is then the rank order: at
three ranks or more it may differ from Gloo's ring in the last bit.

A unit can be a whole parameter group (stage 1), so a collective over it at
once would need a temporary as large as the group. Each is cut into chunks of
at most ``CHUNK_BYTES`` per rank: the temporaries stay small, the bytes on the
wire are the same.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from minddp.collectives_compat import all_gather_single, reduce_scatter_single
from minddp.zero.pairwise import all_gather as all_gather_pairwise
from minddp.zero.pairwise import reduce_scatter as reduce_scatter_pairwise
from minddp.zero.pairwise import runs_pairwise
from minddp.zero.shards import Shard, ShardLayout

__all__ = ["CHUNK_BYTES", "WorkFuture", "completed", "all_gather_params", "reduce_scatter_grads", "gather_to"]

CHUNK_BYTES = 16 * 1024 * 1024


def _chunks(piece: int, element_size: int):
    step = max(1, CHUNK_BYTES // element_size)
    return [(lo, min(lo + step, piece)) for lo in range(0, piece, step)] or [(0, 0)]


def all_gather_params(layout: ShardLayout, shard_tensor: Callable[[Shard], torch.Tensor],
                      dest: Callable[[torch.Tensor], torch.Tensor], group: dist.ProcessGroup) -> None:
    """Every rank's piece of every unit (read from ``shard_tensor``) into ``dest(param)`` on every rank."""
    n = layout.world_size
    for index, unit in enumerate(layout.units):
        mine = layout.piece(index, shard_tensor)
        for lo, hi in _chunks(unit.piece, mine.element_size()):
            gathered = torch.empty(n * (hi - lo), dtype=mine.dtype, device=mine.device)
            if n > 1 and runs_pairwise(group, mine.device):
                all_gather_pairwise(gathered, mine[lo:hi].contiguous(), group).wait()
            elif n > 1:
                all_gather_single(gathered, mine[lo:hi].contiguous(), group=group)
            else:
                gathered.copy_(mine[lo:hi])
            for rank in range(n):
                unit.write(rank, lo, gathered[rank * (hi - lo): (rank + 1) * (hi - lo)], dest)


def reduce_scatter_grads(layout: ShardLayout, source: Callable[[torch.Tensor], torch.Tensor | None],
                         shard_tensor: Callable[[Shard], torch.Tensor], group: dist.ProcessGroup,
                         divisor: int, accumulate: bool = False) -> None:
    """Average ``source(param)`` over the ranks; this rank's piece into ``shard_tensor``.

    Each gradient is multiplied by 1/``divisor`` before the sum, as MiniDDP and
    torch's DDP do (the same rounding as theirs).
    """
    n = layout.world_size
    for index, unit in enumerate(layout.units):
        piece = torch.empty(unit.piece, dtype=unit.dtype, device=unit.device)
        for lo, hi in _chunks(unit.piece, piece.element_size()):
            send = torch.empty(n * (hi - lo), dtype=unit.dtype, device=unit.device)
            for rank in range(n):  # one rank's chunk at a time: no second copy of all of them (a cat's)
                send[rank * (hi - lo): (rank + 1) * (hi - lo)] = unit.read(rank, lo, hi, source)
            send.mul_(1.0 / divisor)
            if n > 1 and runs_pairwise(group, send.device):
                reduce_scatter_pairwise(send, hi - lo, group, out=piece[lo:hi]).wait()
            elif n > 1:
                reduce_scatter_single(piece[lo:hi], send, group=group)
            else:
                piece[lo:hi] = send
        layout.take_piece(index, piece, shard_tensor, accumulate)


def gather_to(layout: ShardLayout, shard_tensor: Callable[[Shard], torch.Tensor],
              dest: Callable[[torch.Tensor], torch.Tensor] | None, to: int, group: dist.ProcessGroup) -> None:
    """Every rank's piece of every unit into ``dest(param)`` on rank ``to`` only (others pass None).

    Chunk by chunk: rank ``to`` holds one chunk per rank at a time on the
    device; ``dest`` may live on the CPU (a checkpoint being assembled).
    """
    n, me = layout.world_size, layout.rank
    for index, unit in enumerate(layout.units):
        mine = layout.piece(index, shard_tensor)
        for lo, hi in _chunks(unit.piece, mine.element_size()):
            chunks = None
            if me == to:
                chunks = [torch.empty(hi - lo, dtype=mine.dtype, device=mine.device) for _ in range(n)]
            if n > 1:
                dist.gather(mine[lo:hi].contiguous(), chunks, dst=dist.get_global_rank(group, to), group=group)
            elif chunks is not None:
                chunks[0].copy_(mine[lo:hi])
            if chunks is not None:
                for rank, values in enumerate(chunks):
                    unit.write(rank, lo, values, dest)


def completed(value: torch.Tensor) -> torch.futures.Future:
    done = torch.futures.Future()
    done.set_result(value)
    return done


class WorkFuture(torch.futures.Future):
    """A future for an asynchronous collective whose work has none (Gloo's reduce-scatter; the
    sends and receives of :mod:`minddp.zero.pairwise`, whose ``PairwiseWork`` sums the piece in ``wait``).

    The collective runs in the background from the launch; ``wait()`` (the
    reducer's, at the end of backward) blocks on it, then hands the piece over.
    """

    def __init__(self, work, value: torch.Tensor, on_done):
        super().__init__()
        self._work, self._value, self._on_done = work, value, on_done

    def done(self) -> bool:
        """Finished in the background? Then hand the piece over now (the reducer asks, to give the
        bucket's buffer back during backward)."""
        if not super().done() and (self._work is None or self._work.is_completed()):
            self.wait()
        return super().done()

    def wait(self):
        if not super().done():
            if self._work is not None:
                self._work.wait()
            self._on_done()
            self.set_result(self._value)
        return super().wait()
