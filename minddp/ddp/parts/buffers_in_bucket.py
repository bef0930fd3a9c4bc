"""Rank 0's buffers ride in the last gradient bucket: one collective fewer per step.

torch's DDP broadcasts the module's buffers (BatchNorm's running statistics)
at the start of every forward that follows a synchronized one: a collective
of its own, and on Gloo each collective costs a fixed latency (about a
millisecond here, several per cent of a small model's step). Two facts make
that collective unnecessary:

* a sum over the ranks in which every rank but 0 contributes zeros *is* a
  broadcast of rank 0's values (x + 0 = x, exactly);
* the buffers torch would broadcast before forward k+1 are rank 0's buffers
  as forward k left them, and backward k does not change them.

So the buffers are appended to the last bucket of backward k, which is
all-reduced anyway, kept aside when it arrives, and written into the
buffers at the start of forward k+1, where torch's broadcast would write
them (``MiniDDP(buffer_sync="with_gradients")``). One object,
:class:`BuffersInLastBucket`, is both what rides in the last bucket (room
there, packed as it is sent, kept as it arrives) and ``MiniDDP``'s buffer
policy before a forward (delivered instead of a broadcast). The reducer
does not know it rides along: :class:`RidesInLastBucket` is a gradients
part around the one the reducer had, that asks for the room and packs
after the gradients are in, and keeps the buffers before they go out. A comm hook (not necessarily a sum) and ``join()`` put the
broadcast back. Every rank's buffers are
then torch's at every moment, with one exception: rank 0 changing its
buffers between a backward and the next forward by something other than
the wrapped forward (a ``load_state_dict`` on rank 0 alone). torch would
broadcast the new values; these are the ones rank 0 sent with the
gradients. That one case is why it is an option and not the default;
rank 0 sees it (its buffers' version counters moved since it sent them)
and warns.

Bit for bit, whatever the buffer's dtype: each buffer travels as its raw
bytes, read as 16-bit integers and carried as float32 values. Every int16
is exactly a float32, and adding zeros changes no value, so integer
counters (``num_batches_tracked``), a -0.0 or a NaN arrive as they left.
The price: 4 bytes on the wire per 2 bytes of buffer, for tensors that are
a few KB.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.distributed as dist

from minddp.ddp.broadcast import BufferSync
from minddp.ddp.core.slots import GradientTransfer

__all__ = ["BuffersInLastBucket", "RidesInLastBucket", "CARRIER_DTYPES"]

# Bucket dtypes that hold every int16 exactly (bf16 and fp16 do not: 8 and 11 bits of mantissa).
CARRIER_DTYPES = (torch.float32, torch.float64)


class BuffersInLastBucket:
    """What rides in the last bucket: ``numel`` extra elements after its gradients.

    :meth:`pack` fills them before the bucket is sent (rank 0: its buffers'
    bytes; every other rank: zeros), :meth:`receive` keeps the sum (rank 0's
    bytes) when the bucket has arrived, and :meth:`before_forward` writes it
    into every rank's buffers before the next forward (:meth:`deliver`), or
    broadcasts them where it cannot.
    """

    def __init__(self, read_buffers: Callable[[], list[torch.Tensor]], group: dist.ProcessGroup, is_source: bool):
        # The buffers are read again at every pack and delivery, as MiniDDP reads them before a
        # broadcast: a forward may re-assign one. Their layout is fixed here (the last bucket's
        # room is); a buffer re-shaped or re-typed since (``model.double()``) goes back to the broadcast.
        self._read_buffers = read_buffers
        self.is_source = is_source
        buffers = self._buffers()
        # Whole 16-bit words of contiguous memory (a 1-byte bool buffer is not).
        self._whole_words = all(b.is_contiguous() and b.numel() * b.element_size() % 2 == 0 for b in buffers)
        self._layout = _layout(buffers)
        self.numel = sum(b.numel() * b.element_size() // 2 for b in buffers) if self._whole_words else 0
        self._received: torch.Tensor | None = None
        self._versions_sent: list[int] = []
        self.arrived = False  # did the last backward bring them? (delivered at the next forward)
        self._broadcast = BufferSync(read_buffers, group, "broadcast")

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in self._read_buffers() if b.numel() > 0]

    def fits(self, bucket_dtype: torch.dtype) -> bool:
        """Can a bucket of ``bucket_dtype`` carry these buffers exactly?"""
        return self._whole_words and bucket_dtype in CARRIER_DTYPES

    def pack(self, tail: torch.Tensor) -> None:
        buffers = self._buffers()
        if not self.is_source or _layout(buffers) != self._layout:
            tail.zero_()  # (rank 0's re-shaped buffers travel by broadcast instead: see deliver)
            return
        self._versions_sent = [b._version for b in buffers]
        offset = 0
        for words in map(_as_int16, buffers):
            tail[offset: offset + words.numel()].copy_(words)  # int16 -> float: exact
            offset += words.numel()

    def receive(self, tail: torch.Tensor) -> None:
        """Keep the arrived bytes (the bucket's buffer may be rebuilt or reused before the next forward)."""
        self.arrived = True
        if self.is_source:
            return  # they are its own buffers' bytes
        if self._received is None:
            self._received = torch.empty_like(tail)
        self._received.copy_(tail)

    def before_forward(self, source: int) -> None:
        """Rank 0's buffers came with the last backward's gradients: written now, where torch's broadcast
        would write them; a broadcast where they did not come or can no longer be written."""
        delivered = self.arrived and self.deliver()
        self.arrived = False
        if not delivered:
            self._broadcast.before_forward(source)

    def deliver(self) -> bool:
        """Rank 0's bytes into this rank's buffers (rank 0 keeps its own, as under a broadcast).

        False, delivering nothing, when the buffers no longer have the layout the bucket was built
        for: the caller broadcasts them instead (the same answer on every rank: the same module).
        """
        buffers = self._buffers()
        if _layout(buffers) != self._layout:
            return False
        if self.is_source:
            if [b._version for b in buffers] != self._versions_sent:
                self._warn_changed()
            return True
        tail, offset = self._received, 0
        for words in map(_as_int16, buffers):
            # Written through .data (see _as_int16): a forward's graph that
            # saved a buffer must not see its version counter move.
            words.copy_(tail[offset: offset + words.numel()])  # float -> int16: exact
            offset += words.numel()
        return True

    @staticmethod
    def _warn_changed() -> None:
        warnings.warn(
            "MiniDDP(buffer_sync='with_gradients'): rank 0's buffers changed between the last backward and "
            "this forward, outside the wrapped forward; the other ranks get the values sent with the "
            "gradients, not the new ones (torch's DDP would broadcast the new ones). Use "
            "buffer_sync='broadcast' if buffers are changed between steps.", stacklevel=4)


class RidesInLastBucket(GradientTransfer):
    """A gradients part around ``inner``: ``passenger``'s room after the last bucket's gradients (where the
    bucket's dtype carries it exactly), packed once the gradients are in, kept once the sum has arrived."""

    def __init__(self, inner: GradientTransfer, passenger: BuffersInLastBucket):
        self.inner, self.passenger = inner, passenger

    def room_after_gradients(self, bucket_index: int, bucket_count: int, dtype: torch.dtype) -> int:
        last = bucket_index == bucket_count - 1
        return self.passenger.numel if last and self.passenger.fits(dtype) else 0

    def buckets_built(self, reducer) -> None:
        self.inner.buckets_built(reducer)

    def gradient_ready(self, bucket, position: int, param) -> None:
        self.inner.gradient_ready(bucket, position, param)

    def fill_bucket(self, bucket, scale: float) -> None:
        self.inner.fill_bucket(bucket, scale)
        if bucket.extra_numel:  # after: the inner part may scale the whole buffer
            self.passenger.pack(bucket.tail)

    def write_grads(self, bucket, used: list[bool] | None) -> None:
        if bucket.extra_numel:
            self.passenger.receive(bucket.tail)
        self.inner.write_grads(bucket, used)


def _layout(buffers: list[torch.Tensor]) -> list[tuple]:
    return [(b.shape, b.dtype) for b in buffers]


def _as_int16(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer's bytes as a flat int16 view (shares its memory; ``.data``: no version bump)."""
    return buffer.data.reshape(-1).view(torch.int16)
