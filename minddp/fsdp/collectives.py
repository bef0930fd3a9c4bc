"""How a unit's reduce-scatter goes on the wire, and why not always as ``reduce_scatter_tensor``.

On Gloo, torch's ``reduce_scatter_tensor`` is not a reduce-scatter:
``ProcessGroupGloo`` (torch 2.14) clones the whole input on the caller's
thread, all-reduces the clone, and copies this rank's chunk out when the work
is waited for. That is an all-reduce's traffic (twice a reduce-scatter's),
plus one more full-size buffer and copy per unit per step. So on Gloo:

* at two ranks, a real reduce-scatter: the peer's half of the send buffer
  goes out and the peer's half for this rank comes in, as one exchange
  (:func:`minddp.zero.pairwise.reduce_scatter`), and this rank adds its own
  half: half the bytes, one collective, and half the CPU of the all-reduce
  in a real step (``benchmarks/experiments/fsdp_threads.py``). ``a + b == b + a``, so
  the same bits as Gloo's all-reduce;
* at three or more, a unit's send buffer is already a private copy of its
  gradients, so all-reducing *it* in place and reading this rank's chunk runs
  the very same all-reduce as torch's, hence the same bits, without the
  clone.

Any other backend (NCCL) has a real reduce-scatter, and gets it.

Life cycle: :func:`start_reduce_scatter` launches (asynchronously) and returns
a :class:`PendingReduceScatter`, which keeps the send buffer alive until
:meth:`~PendingReduceScatter.wait` hands back this rank's piece in a storage of
its own (so a gradient made of it does not pin the full-size buffer).

"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from minddp.collectives_compat import all_gather_single as all_gather
from minddp.collectives_compat import reduce_scatter_single as _reduce_scatter
from minddp.zero import pairwise

__all__ = ["PendingReduceScatter", "all_gather", "gloo_collectives", "start_reduce_scatter"]
_TORCHS_OWN = {getattr(distributed_c10d, name, None) for name in ("reduce_scatter_single", "reduce_scatter_tensor")}


def gloo_collectives(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` runs torch's own reduce-scatter of tensors on ``device`` through Gloo (an all-reduce inside).

    A collective someone wrapped (a simulated link, a tracer) is not
    replaced: it is called, as it was meant to be.
    """
    if _reduce_scatter not in _TORCHS_OWN:
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or (device.type == "cpu" and "cpu:gloo" in backend)


class PendingReduceScatter:
    """A launched reduce-scatter: its work, its send buffer, and where this rank's piece will be."""

    def __init__(self, work, send: torch.Tensor, result: torch.Tensor, result_in_send: bool):
        self._work, self._send, self._result, self._result_in_send = work, send, result, result_in_send

    def wait(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's averaged piece, in ``dtype``, in a storage of its own; the send buffer is let go."""
        if self._work is not None:
            self._work.wait()
        piece = self._result.to(dtype, copy=self._result_in_send)
        self._work = self._send = self._result = None
        return piece


def start_reduce_scatter(send: torch.Tensor, piece: int, rank: int, group: dist.ProcessGroup,
                         on_gloo: bool) -> PendingReduceScatter:
    """Sum ``send`` (``world size x piece`` elements) over the ranks; this rank keeps chunk ``rank``.

    ``on_gloo`` (torch's own Gloo collectives, :func:`gloo_collectives`):
    at two ranks, exchange halves; at more, sum the whole buffer in place
    (what Gloo's reduce-scatter does, on a clone). Else a real
    reduce-scatter. The exchange and the real reduce-scatter sum into a new
    ``piece``-long tensor. A world of one only reads its own chunk.
    """
    mine = send[rank * piece: (rank + 1) * piece]
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return PendingReduceScatter(None, send, mine, result_in_send=True)
    if on_gloo and world_size > 2:
        return PendingReduceScatter(dist.all_reduce(send, group=group, async_op=True), send, mine, result_in_send=True)
    result = torch.empty(piece, dtype=send.dtype, device=send.device)
    if on_gloo:  # two ranks: one exchange
        work = pairwise.reduce_scatter(send, piece, group, out=result)
    else:
        work = _reduce_scatter(result, send, group=group, async_op=True)
    return PendingReduceScatter(work, send, result, result_in_send=False)
