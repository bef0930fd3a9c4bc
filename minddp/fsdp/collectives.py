"""How a unit's collectives go on the wire: torch's, or on Gloo sends and receives by hand.

A unit needs two collectives per step: an all-gather of every rank's piece
into its full parameters (before forward, and again before backward), and a
reduce-scatter of its flat gradient into this rank's piece (after backward).
NCCL has both, and gets them. On Gloo (torch 2.14, CPU) torch's
``reduce_scatter_tensor`` clones the whole input and all-reduces the clone,
and its all-reduce and all-gather spend several times the CPU their bytes
need; :mod:`minddp.zero.pairwise` sends each piece straight to the rank that
needs it instead (and a collective someone wrapped, a simulated link or a
tracer, is called as it was meant to be: :func:`~minddp.zero.pairwise.runs_pairwise`).

Life cycle of a reduce-scatter: :func:`start_reduce_scatter` launches it
(asynchronously) and returns a :class:`PendingReduceScatter`, which keeps the
send buffer alive until :meth:`~PendingReduceScatter.wait` hands back this
rank's piece in a storage of its own (so a gradient made of it does not pin
the full-size buffer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minddp.zero import pairwise

__all__ = ["PendingReduceScatter", "runs_pairwise", "start_all_gather", "start_reduce_scatter"]

runs_pairwise = pairwise.runs_pairwise

# torch 2.14 renamed these (the old names warn); keep working on both. Bound
# at import, so a wrapper installed before (lesson 22's simulated link) is
# the one called.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def start_all_gather(full: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup, by_hand: bool):
    """Every rank's ``mine`` into ``full`` (asynchronously); returns what to ``wait()`` on."""
    if by_hand:
        return pairwise.all_gather(full, mine, group)
    return _all_gather(full, mine, group=group, async_op=True)


class PendingReduceScatter:
    """A launched reduce-scatter: its work, its send buffer, and where this rank's piece will be."""

    def __init__(self, work, send: torch.Tensor, result: torch.Tensor | None, result_in_send: bool):
        self._work, self._send, self._result, self._result_in_send = work, send, result, result_in_send

    def wait(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's averaged piece, in ``dtype``, in a storage of its own; the send buffer is let go."""
        waited = self._work.wait() if self._work is not None else None
        result = self._result if self._result is not None else waited
        piece = result.to(dtype, copy=self._result_in_send)
        self._work = self._send = self._result = None
        return piece


def start_reduce_scatter(send: torch.Tensor, piece: int, rank: int, group: dist.ProcessGroup,
                         by_hand: bool) -> PendingReduceScatter:
    """Sum ``send`` (``world size x piece`` elements) over the ranks; this rank keeps chunk ``rank``.

    ``by_hand``: sends and receives (:func:`minddp.zero.pairwise.reduce_scatter`,
    the piece summed in rank order into a new tensor); else torch's
    reduce-scatter into a new ``piece``-long tensor. A world of one only
    reads its own chunk.
    """
    if dist.get_world_size(group) == 1:
        return PendingReduceScatter(None, send, send[rank * piece: (rank + 1) * piece], result_in_send=True)
    if by_hand:
        return PendingReduceScatter(pairwise.reduce_scatter(send, piece, group), send, None, result_in_send=False)
    result = torch.empty(piece, dtype=send.dtype, device=send.device)
    work = _reduce_scatter(result, send, group=group, async_op=True)
    return PendingReduceScatter(work, send, result, result_in_send=False)
