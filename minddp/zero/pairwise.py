"""Reduce-scatter and all-gather as pairwise sends: what Gloo does not do well, done by hand.

ZeRO's two collectives are simple to state. In a reduce-scatter every rank
owns one chunk of a buffer (chunk ``r`` for rank ``r``): each rank sends every
other rank that rank's chunk and adds up the chunks it receives for its own.
In an all-gather each rank sends its piece to every other rank, and receives
theirs into their places. Each rank sends (N-1)/N of the buffer, the least any
algorithm sends.

On Gloo (torch 2.14, CPU), torch's ``reduce_scatter_tensor`` is not that: it
clones the whole input and all-reduces the clone, twice the bytes and a
full-size buffer more. Sending by hand sends half as much and needs (N-1)/N
of a buffer to receive into.

At two ranks each collective is one exchange with the one peer, and it goes
as one Gloo collective: ``all_to_all_single`` with nothing sent to oneself
(the peer's chunk out, this rank's in), run on Gloo's worker thread like any
collective. Between real computation that costs half the CPU of the
all-reduce (``benchmarks/experiments/pairwise_collectives.py``, and ``minddp.fsdp``'s
step in ``benchmarks/experiments/fsdp_threads.py``). At three ranks and more the sends
and receives are posted one by one; there, called back to back on an idle
machine they cost a third of the CPU of Gloo's collectives, but between real
computation on a loaded machine the difference is lost in the noise, and
posting a send or a receive can block the caller while Gloo's network thread
holds the connection. :func:`runs_pairwise` says where they apply (Gloo on
CPU, no wrapped collectives).

The sum: chunk by chunk in rank order, ``((c0 + c1) + c2) + ...``. At two
ranks that is the same bits as any all-reduce (``a + b == b + a``); at three
or more it can differ from Gloo's ring in the last bit (float32 summation
order), as NCCL's ring differs from Gloo's.

Every rank must call these in the same order: sends and receives between two
ranks pair up in the order they were posted (a tag per kind of collective
keeps them apart from any other sends on the group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["PairwiseWork", "all_gather", "reduce_scatter", "runs_pairwise"]

_GATHER_TAG, _SCATTER_TAG = 0x6761, 0x7273

# Bound at import, so a wrapper installed before (lesson 22's simulated link,
# a tracer) is seen, and then called as it was meant to be.
_COLLECTIVES = {name: getattr(dist, name, None) for name in
                ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")}
_TORCHS_OWN = {getattr(distributed_c10d, name, None) for name in _COLLECTIVES}


def runs_pairwise(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether to send by hand: Gloo on CPU, with torch's own collectives (none wrapped by someone)."""
    if any(f is not None and f not in _TORCHS_OWN for f in _COLLECTIVES.values()):
        return False
    backend = str(dist.get_backend(group))
    return device.type == "cpu" and (backend == "gloo" or "cpu:gloo" in backend)


class PairwiseWork:
    """The sends and receives of one collective; :meth:`wait` finishes them and returns the result."""

    def __init__(self, works: list, finish=None):
        self._works, self._finish, self._result = works, finish, None

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self):
        for work in self._works:
            work.wait()
        self._works = []
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


def _peers(group: dist.ProcessGroup) -> list[tuple[int, int]]:
    """(rank in the group, global rank) of every other rank, in rank order."""
    me = dist.get_rank(group)
    return [(r, dist.get_global_rank(group, r)) for r in range(dist.get_world_size(group)) if r != me]


def _exchange(received: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup):
    """Two ranks: ``sent`` to the peer, the peer's into ``received``, as one collective (the work)."""
    sizes = [0, sent.numel()] if dist.get_rank(group) == 0 else [sent.numel(), 0]  # nothing to oneself
    return dist.all_to_all_single(received, sent, sizes, sizes, group=group, async_op=True)


def all_gather(output: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup) -> PairwiseWork:
    """Every rank's ``mine`` into ``output`` (N pieces end to end): received straight into place."""
    piece, me = mine.numel(), dist.get_rank(group)
    output[me * piece: (me + 1) * piece].copy_(mine)
    if dist.get_world_size(group) == 2:
        return PairwiseWork([_exchange(output[(1 - me) * piece: (2 - me) * piece], mine, group)])
    works = []
    for rank, global_rank in _peers(group):
        works.append(dist.isend(mine, global_rank, group=group, tag=_GATHER_TAG))
        works.append(dist.irecv(output[rank * piece: (rank + 1) * piece], global_rank, group=group, tag=_GATHER_TAG))
    return PairwiseWork(works)


def reduce_scatter(send: torch.Tensor, piece: int, group: dist.ProcessGroup,
                   out: torch.Tensor | None = None) -> PairwiseWork:
    """Sum chunk ``rank`` of ``send`` (N chunks of ``piece``) over the ranks; ``wait()`` returns it.

    The sum lands in ``out`` if given (``piece`` elements), else in a new
    tensor. ``send`` must not change until then; its other chunks are sent
    as they are, and its own chunk is read, not written.

    Memory: one of the sum's first two terms is received straight into the
    result (the first summand of a ``+`` may be either: ``a + b == b + a``,
    bit for bit), so only N-2 chunks are received into temporaries: none
    at two ranks.
    """
    me, n = dist.get_rank(group), dist.get_world_size(group)
    chunks = list(send.split(piece))
    total = out if out is not None else torch.empty(piece, dtype=send.dtype, device=send.device)
    into_total = 1 if me == 0 else 0  # the rank whose chunk is received into the result itself
    if n == 2:
        return PairwiseWork([_exchange(total, chunks[1 - me], group)], lambda: total.add_(chunks[me]))
    received: dict[int, torch.Tensor] = {}
    works = []
    for rank, global_rank in _peers(group):
        works.append(dist.isend(chunks[rank], global_rank, group=group, tag=_SCATTER_TAG))
        received[rank] = total if rank == into_total else \
            torch.empty(piece, dtype=send.dtype, device=send.device)
        works.append(dist.irecv(received[rank], global_rank, group=group, tag=_SCATTER_TAG))

    def add_up() -> torch.Tensor:
        if n == 1:
            return total.copy_(chunks[me])
        parts = [received.get(r, chunks[me]) for r in range(n)]
        total.add_(parts[1 - into_total])  # now chunk 0 + chunk 1
        for part in parts[2:]:
            total.add_(part)
        return total

    return PairwiseWork(works, add_up)
