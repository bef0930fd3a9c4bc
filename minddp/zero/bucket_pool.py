"""Stage 2's bucket buffers: lent to the buckets in flight during backward, none kept between steps.

MiniDDP keeps one flat buffer per bucket for the whole run: a second copy of
every gradient (torch's DDP does the same). Stage 2 needs none of it once a
bucket has been reduce-scattered: its average lives, 1/N of it, in the
optimizer's shard. So stage 2 gives the reducer this storage
(``Reducer.use_bucket_storage``, :class:`~minddp.ddp.core.buckets.BucketStorage`'s
hook point): a bucket takes a buffer at its first gradient (each gradient
goes into its slot at its hook, and autograd's ``.grad`` is let go at once:
with ``slots_at_hook``, stage 2 picks MiniDDP's bucket-views part,
:mod:`minddp.ddp.parts.bucket_views`) and gives it back as soon as its reduce-scatter arrived
and the optimizer took the piece, during backward. Only the buckets in
flight hold one: a few buckets' worth of memory, not the model's.

A buffer is allocated the size of the bucket that needs it (rounded up to
a multiple of N: the room past the gradients is where the reduce-scatter's
zero padding goes, :meth:`BucketPool.padded`, no padded copy), never the
largest bucket's size for all. A buffer given back is lent again, in the
same backward, to a later bucket it holds: freeing it and allocating anew
could have both alive at once, as Gloo's thread lets go of a finished
collective's tensors a moment late. One too small for the bucket that needs
a buffer next is let go, and at the end of backward :meth:`BucketPool.let_go`
drops whatever is left: between steps the pool holds nothing. (DeepSpeed
allocates its reduce buckets every backward too.)
"""

from __future__ import annotations

import torch

from minddp.ddp.core.buckets import BucketStorage

__all__ = ["BucketPool"]


class BucketPool(BucketStorage):
    """Lends flat buffers to MiniDDP's buckets and takes them back (``keep_buffers = False``)."""

    keep_buffers = False
    slots_at_hook = True  # each gradient copied into its bucket at its hook (False: when the bucket is complete)

    def __init__(self, multiple_of: int):
        self.multiple_of = multiple_of
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent buffer -> the whole pool buffer

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, lent or free (what it costs in memory)."""
        return self._free + list(self._lent.values())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        need = -(-numel // self.multiple_of) * self.multiple_of
        fits = [b for b in self._free if b.numel() >= need and (b.dtype, b.device) == (dtype, device)]
        found = min(fits, key=torch.Tensor.numel) if fits else None
        self._free = []  # what does not hold this bucket is not kept for a later one
        if found is None:
            found = torch.empty(need, dtype=dtype, device=device)
        self._lent[found.data_ptr()] = found
        return found[:numel]

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.append(self._lent.pop(buffer.data_ptr()))

    def let_go(self) -> None:
        """Drop the free buffers (the end of a backward: no bucket needs one before the next)."""
        self._free = []

    def padded(self, buffer: torch.Tensor, length: int) -> torch.Tensor | None:
        """``buffer`` (lent by this pool) extended to ``length`` elements with zeros; None if no room."""
        whole = self._lent.get(buffer.data_ptr())
        if whole is None or whole.numel() < length:
            return None
        whole[buffer.numel(): length].zero_()
        return whole[:length]
