"""A gradient bucket: one flat buffer and its life cycle.

Why buckets at all? One all-reduce per parameter pays the collective's fixed
latency hundreds of times per step; one all-reduce of every gradient at the
end cannot start before backward is over, so nothing overlaps. A bucket is
the middle ground: a flat buffer holding the gradients of a few parameters,
all-reduced as soon as its last gradient is in, while autograd goes on
computing the gradients of earlier layers.

Which parameters share a bucket is decided by
:func:`minddp.bucket_assignment.assign_buckets`; what lives here is
:class:`Bucket`, the flat buffer plus its life cycle::

      reset() ─> mark_ready(p) ... mark_ready(p) ─> launch(comm) ─> wait() ─> reset()
                 (one per parameter; the last one       (async)      (result in
                  makes the bucket ready)                             buffer)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Bucket", "BucketStorage", "ScratchBucket"]

# Above this mean size (elements), a bucket's gradients are copied and scaled
# one by one in a single fused pass each; below, in two batched calls.
LARGE_GRADIENT_NUMEL = 64 * 1024


def _slot(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """``param``'s slot in ``buffer`` from ``offset``, laid out in memory like ``param``.

    A ``channels_last`` convolution weight has strides ``(27, 1, 9, 3)``, not
    the contiguous ``(27, 9, 3, 1)``. Its ``.grad`` follows the parameter's
    layout (autograd's rule), and so must its slot: a bucket view used as
    ``.grad`` then has the parameter's strides (fused optimizers walk
    parameter and gradient as flat memory, and refuse or mix up mismatched
    ones), and a copy into the slot is a plain copy, not a permutation.
    As torch's reducer: the parameter's strides when it is dense and
    non-overlapping, else a contiguous slot.
    """
    if _dense_and_non_overlapping(param):
        return buffer.as_strided(param.shape, param.stride(), offset)
    return buffer[offset : offset + param.numel()].view(param.shape)


def _dense_and_non_overlapping(t: torch.Tensor) -> bool:
    """Do ``t``'s elements fill ``numel`` consecutive places, in some order of its dims?"""
    expected = 1
    dims = sorted(((size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1), key=lambda d: d[1])
    for size, stride in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class BucketStorage:
    """Where bucket buffers come from, and where they go back: a hook point.

    This default allocates one buffer per bucket, and the bucket keeps it
    for the whole run (``keep_buffers``), as torch's DDP does. A storage
    with ``keep_buffers = False`` (ZeRO stage 2's pool, in
    :mod:`minddp.zero`) gets every buffer back as soon as its bucket's
    result has been taken elsewhere, and lends it out again when a bucket
    next needs one: a few buffers in flight instead of a full gradient copy.
    Buffers come back dirty: every slot is overwritten before it is sent.
    A storage with ``slots_at_hook = True`` has each dense gradient copied
    into its slot at its hook and ``.grad`` made that slot, as
    ``gradient_as_bucket_view`` does: autograd's own ``.grad`` is let go at
    once, not when the whole bucket is complete.
    """

    keep_buffers = True
    slots_at_hook = False

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        pass


class Bucket:
    """A flat gradient buffer for a few parameters, and its life cycle.

    The bucket owns ``buffer``, one contiguous tensor; each parameter's
    gradient has a fixed slot in it (:meth:`view`), with the parameter's
    own memory layout (:func:`_slot`). States:

    * *filling*: :meth:`mark_ready` counts parameters whose gradient has been
      copied into their slot; it returns True for the last one;
    * *launched*: :meth:`launch` started the asynchronous communication;
    * *done*: :meth:`wait` blocked until it finished and left the reduced
      values in ``buffer``.

    :meth:`reset` returns it to *filling* for the next step. The buffer
    itself comes from a :class:`BucketStorage`: :meth:`acquire` before the
    first slot is written, :meth:`release` once the result is no longer
    needed (with the default storage, acquired once and never released).
    Misuse (a
    parameter marked twice, a launch before all are ready, a wait without a
    launch) raises ``RuntimeError``: it would mean gradients were summed
    twice, or sent before they existed.
    """

    def __init__(
        self, index: int, params: list[torch.nn.Parameter], names: list[str], dtype: torch.dtype | None = None,
        storage: BucketStorage | None = None, extra_numel: int = 0,
    ):
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.params = params
        self.names = names
        # ``extra_numel``: room after the gradients for a passenger (the reducer's ``carry_in_last_bucket``).
        self.extra_numel = extra_numel
        self.numel = sum(p.numel() for p in params) + extra_numel
        self.dtype = dtype or params[0].dtype  # what the gradients are reduced in (default: the parameters')
        self.storage = storage or BucketStorage()
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # each parameter's slot, in ``params`` order
        if self.storage.keep_buffers:
            self.acquire()
        self._position = {id(p): i for i, p in enumerate(params)}
        self._ready = [False] * len(params)
        self._pending = len(params)
        self._future: torch.futures.Future | None = None

    def acquire(self) -> None:
        """Have a buffer (from the storage) and the slots into it."""
        if self.buffer is not None:
            return
        self.buffer = self.storage.take(self.numel, self.dtype, self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(_slot(self.buffer, offset, p))
            offset += p.numel()

    @property
    def tail(self) -> torch.Tensor:
        """The ``extra_numel`` elements after the gradients' slots."""
        return self.buffer[self.numel - self.extra_numel:]

    def release(self) -> None:
        """Give the buffer back to the storage; a ``.grad`` that was a slot of it is dropped
        (the buffer will hold another bucket's gradients)."""
        if self.buffer is None:
            return
        for p, slot in zip(self.params, self.views):
            if p.grad is slot:
                p.grad = None
        self.storage.give_back(self.buffer)
        self.buffer, self.views = None, []

    def copy_in(self, grads: list[torch.Tensor], slots: list[torch.Tensor], scale: float) -> None:
        """Copy ``grads`` into their ``slots``, and leave the whole buffer scaled by ``scale``.

        Every Python-dispatched tensor operation costs microseconds, every
        pass over memory costs bytes / bandwidth. Measured on this project's
        CPU (a 25 MB bucket of 5 MLP gradients; 48 transformer gradients):
        a fused ``slot = grad * scale`` per gradient is fastest for large
        gradients (1.0 ms against 1.4), one ``_foreach_copy_`` plus one
        ``buffer.mul_`` for many small ones (0.08 ms against 0.17). Slots not
        in ``slots`` (gradients already there, zeros) are scaled in place.
        """
        large = bool(grads) and sum(g.numel() for g in grads) >= LARGE_GRADIENT_NUMEL * len(grads)
        if not large:
            if grads:
                torch._foreach_copy_(slots, grads)  # casts too, with reduce_dtype
            if scale != 1.0:
                self.buffer.mul_(scale)
            return
        for grad, slot in zip(grads, slots):
            if scale == 1.0:  # a comm hook averages: a plain copy (casts too)
                slot.copy_(grad)
            elif grad.dtype == slot.dtype:
                torch.mul(grad, scale, out=slot)
            else:  # reduce_dtype: cast first, so the scaling rounds only once
                slot.copy_(grad).mul_(scale)
        if scale != 1.0:
            copied = {id(slot) for slot in slots}
            for slot in self.views:
                if id(slot) not in copied:
                    slot.mul_(scale)

    def view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This parameter's slot in the buffer, shaped like the parameter."""
        return self.views[self._position[id(param)]]

    @property
    def ready(self) -> bool:
        return self._pending == 0

    @property
    def launched(self) -> bool:
        return self._future is not None

    def unready_params(self) -> list[torch.nn.Parameter]:
        return [p for p, r in zip(self.params, self._ready) if not r]

    def unready_names(self) -> list[str]:
        return [n for n, r in zip(self.names, self._ready) if not r]

    def mark_ready(self, param: torch.nn.Parameter) -> bool:
        """Record that ``param``'s gradient is in its slot; True if it was the last."""
        return self.mark_ready_at(self._position[id(param)])

    def mark_ready_at(self, i: int) -> bool:
        """:meth:`mark_ready` for ``params[i]`` (the reducer's hooks know ``i`` in advance)."""
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self.names[i]!r} produced a gradient twice in one backward "
                "(a second backward through the same graph, or a block run twice under a reentrant "
                "activation checkpoint: construct MiniDDP(..., static_graph=True) for that); "
                "its bucket was already marked ready. (torch's DDP says: Expected to mark a variable "
                "ready only once.)"
            )
        self._ready[i] = True
        self._pending -= 1
        return self._pending == 0

    def launch(self, communicate: Callable[["Bucket"], torch.futures.Future]) -> None:
        """Start communication; ``communicate`` returns a future of the reduced buffer."""
        if not self.ready:
            raise RuntimeError(f"bucket {self.index} launched with unready parameters {self.unready_names()}")
        self.launch_unconditionally(communicate)

    def launch_unconditionally(self, communicate: Callable[["Bucket"], torch.futures.Future]) -> None:
        """Launch whatever the buffer holds (a joined rank's zeros, see minddp.join)."""
        self._future = communicate(self)

    @property
    def future(self) -> torch.futures.Future | None:
        return self._future

    def wait(self) -> None:
        """Block until the communication finished; the result is in ``buffer``."""
        if self._future is None:
            raise RuntimeError(f"bucket {self.index} waited on before it was launched")
        result = self._future.wait()
        if isinstance(result, list):  # a Work's future yields the list of its tensors
            result = result[0]
        if result is not self.buffer and result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result)  # a comm hook may return a new tensor
        self._future = None

    def reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = len(self.params)
        self._future = None


@dataclass
class ScratchBucket:
    """A stand-in :class:`Bucket` with no parameters: a scratch buffer sent the way buckets travel
    (``Reducer.communicate_buffer``). Its index is past the real buckets', so no comm hook mistakes it for one."""

    buffer: torch.Tensor
    index: int
    params: tuple = ()
    views: tuple = ()
