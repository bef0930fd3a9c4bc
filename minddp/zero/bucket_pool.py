"""Stage 2's bucket buffers: a few, lent to the buckets in flight, instead of one per bucket for good.

MiniDDP keeps one flat buffer per bucket for the whole run: a second copy of
every gradient (torch's DDP does the same). Stage 2 needs none of it once a
bucket has been reduce-scattered: its average lives, 1/N of it, in the
optimizer's shard. So stage 2 gives the reducer this storage
(``Reducer.use_bucket_storage``, :class:`~minddp.buckets.BucketStorage`'s
hook point): a bucket takes a buffer when its first gradient needs a slot,
and gives it back as soon as its reduce-scatter arrived and the optimizer
took the piece, during backward. Only the buckets in flight hold one: a few
buckets' worth of memory, not the model's.

Every buffer is as large as the largest bucket seen (rounded up to a
multiple of N), so any free one fits any bucket and the pool stops growing
after the first backward; a smaller one is dropped when a larger is needed.
The room past a bucket's gradients is where the reduce-scatter's zero
padding goes (:meth:`BucketPool.padded`): no padded copy of the bucket.
"""

from __future__ import annotations

import torch

from minddp.buckets import BucketStorage

__all__ = ["BucketPool"]


class BucketPool(BucketStorage):
    """Lends flat buffers to MiniDDP's buckets and takes them back (``keep_buffers = False``)."""

    keep_buffers = False

    def __init__(self, multiple_of: int):
        self.multiple_of = multiple_of
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent buffer -> the whole pool buffer
        self._largest: dict[tuple, int] = {}  # (dtype, device) -> elements of every buffer of that kind

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, lent or free (what it costs in memory)."""
        return self._free + list(self._lent.values())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kind = (dtype, device)
        need = -(-numel // self.multiple_of) * self.multiple_of
        if need > self._largest.get(kind, 0):  # a larger bucket: free buffers of this kind are too small now
            self._largest[kind] = need
            self._free = [b for b in self._free if (b.dtype, b.device) != kind]
        size = self._largest[kind]
        found = next((b for b in self._free if (b.dtype, b.device) == kind and b.numel() == size), None)
        if found is None:
            found = torch.empty(size, dtype=dtype, device=device)
        else:
            self._free.remove(found)
        self._lent[found.data_ptr()] = found
        return found[:numel]

    def give_back(self, buffer: torch.Tensor) -> None:
        whole = self._lent.pop(buffer.data_ptr())
        if whole.numel() == self._largest[(whole.dtype, whole.device)]:
            self._free.append(whole)  # else it was outgrown while lent: let it go

    def padded(self, buffer: torch.Tensor, length: int) -> torch.Tensor | None:
        """``buffer`` (lent by this pool) extended to ``length`` elements with zeros; None if no room."""
        whole = self._lent.get(buffer.data_ptr())
        if whole is None or whole.numel() < length:
            return None
        whole[buffer.numel(): length].zero_()
        return whole[:length]
