"""A gradient bucket: one flat buffer and its life cycle.

Why buckets at all? One all-reduce per parameter pays the collective's fixed
latency hundreds of times per step; one all-reduce of every gradient at the
end cannot start before backward is over, so nothing overlaps. A bucket is
the middle ground: a flat buffer holding the gradients of a few parameters,
all-reduced as soon as its last gradient is in, while autograd goes on
computing the gradients of earlier layers.

Which parameters share a bucket is decided by
:func:`minddp.ddp.core.assignment.assign_buckets`; what lives here is
:class:`Bucket`, the flat buffer plus its life cycle, as the reducer
(:mod:`minddp.ddp.core.reducer`) drives it::

    mark_ready_at(i) ... mark_ready_at(i)   one per parameter: a count, no copy;
                                            True for the last one
    copy_in(grads, slots, 1/N)              then every gradient into its slot, in one batch
    launch(communicate)                     the async all-reduce of the whole buffer
    wait()                                  the sum is in the buffer
    reset()                                 ready for the next backward
"""

from __future__ import annotations

from typing import Callable

import torch

import minddp.ddp.core.messages as messages

__all__ = ["Bucket", "BucketStorage", "slot_in"]

# Above this mean size (elements), a bucket's gradients are copied and scaled
# one by one in a single fused pass each; below, in two batched calls.
LARGE_GRADIENT_NUMEL = 64 * 1024


class BucketStorage:
    """Where bucket buffers come from: one per bucket, kept for the whole run (torch's way). ZeRO
    stage 2 and ``lazy_bucket_allocation`` lend them instead (:mod:`minddp.ddp.parts.lent_buckets`)."""

    keep_buffers = True
    release_after_backward = False  # give a buffer back once its averages are in .grad

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        pass


def slot_in(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """``param``'s slot in ``buffer`` from ``offset``, laid out in memory like ``param`` (as torch's reducer).

    A ``channels_last`` weight's ``.grad`` has the weight's strides (autograd's rule), and so must
    its slot: a bucket view used as ``.grad`` then suits fused optimizers (which walk parameter and
    gradient as flat memory), and a copy into the slot is a plain copy, not a permutation.
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


class Bucket:
    """A flat gradient buffer for a few parameters, and its life cycle.

    Each parameter's gradient has a fixed slot in ``buffer`` (``views[i]``),
    with the parameter's own memory layout. :meth:`mark_ready_at`
    only counts: the gradients are copied in by :meth:`copy_in` once the last
    one is ready. Misuse (a parameter marked twice, a launch before all are
    ready, a wait without a launch) raises ``RuntimeError``: it would mean
    gradients summed twice, or sent before they existed.

    ``dtype``: what the gradients are reduced in (default: the parameters').
    ``extra_numel``: room after the gradients (``tail``) for what rides along
    (:mod:`minddp.ddp.parts.buffers_in_bucket`). ``storage``: where the buffer
    comes from; the default one allocates it here, once. ``indices``: the
    parameters' indices in the reducer's list.
    """

    def __init__(
        self, index: int, params: list[torch.nn.Parameter], names: list[str], indices: list[int],
        dtype: torch.dtype | None = None, storage: BucketStorage | None = None, extra_numel: int = 0,
    ):
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index, self.params, self.names = index, params, names
        self.indices = indices
        self.extra_numel = extra_numel
        self.numel = sum(p.numel() for p in params) + extra_numel
        self.dtype = dtype or params[0].dtype
        self.storage = storage or BucketStorage()
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        # How copy_in copies, decided once: one fused pass per large gradient, or two batched calls;
        # a cast first when the bucket's dtype is not the gradients' (reduce_dtype).
        self._one_by_one = self.numel - extra_numel >= LARGE_GRADIENT_NUMEL * len(params)
        self._casts = any(p.dtype != self.dtype for p in params)
        self._ready = [False] * len(params)
        self.pending = len(params)  # parameters not ready yet
        self.future: torch.futures.Future | None = None  # set by launch, cleared by wait
        self.done = False  # waited for: the result is in the buffer
        if self.storage.keep_buffers:
            self.acquire()

    def acquire(self) -> None:
        """Have a buffer (from the storage) and the slots into it."""
        if self.buffer is not None:
            return
        self.buffer = self.storage.take(self.numel, self.dtype, self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(slot_in(self.buffer, offset, p))
            offset += p.numel()

    def release(self) -> None:
        """Give the buffer back to the storage; a ``.grad`` that was a slot of it is dropped."""
        if self.buffer is None:
            return
        for p, slot in zip(self.params, self.views):
            if p.grad is slot:
                p.grad = None
        self.storage.give_back(self.buffer)
        self.buffer, self.views = None, []

    @property
    def tail(self) -> torch.Tensor:
        """The ``extra_numel`` elements after the gradients' slots."""
        return self.buffer[self.numel - self.extra_numel:]

    # ----------------------------------------------------------- life cycle
    def mark_ready_at(self, i: int) -> bool:
        """Count ``params[i]``'s gradient as ready; True if it was the bucket's last."""
        if self._ready[i]:
            raise RuntimeError(messages.gradient_twice(self.names[i]))
        self._ready[i] = True
        self.pending -= 1
        return self.pending == 0

    def copy_in(self, grads: list[torch.Tensor], slots: list[torch.Tensor], scale: float) -> None:
        """Copy ``grads`` into their ``slots``; leave every slot (those not listed hold their
        gradient already) scaled by ``scale``. Measured on this project's CPU: a fused
        ``slot = grad * scale`` per gradient is fastest for large gradients (1.0 ms against 1.4
        for 5 MLP gradients in 25 MB), one ``_foreach_copy_`` plus one ``buffer.mul_`` for many
        small ones (0.08 ms against 0.17 for 48 transformer gradients)."""
        if not self._one_by_one:
            if grads:
                torch._foreach_copy_(slots, grads)  # casts too, with reduce_dtype
            if scale != 1.0:
                self.buffer.mul_(scale)
            return
        for grad, slot in zip(grads, slots):
            if scale == 1.0 or self._casts:  # cast first, so the scaling rounds only once
                slot.copy_(grad)
                if scale != 1.0:
                    slot.mul_(scale)
            else:
                torch.mul(grad, scale, out=slot)
        if len(slots) < len(self.views) and scale != 1.0:
            copied = {id(slot) for slot in slots}
            for slot in self.views:
                if id(slot) not in copied:
                    slot.mul_(scale)

    def launch(self, communicate: Callable[["Bucket"], torch.futures.Future]) -> None:
        """Start communication; ``communicate`` returns a future of the reduced buffer."""
        if self.pending:
            raise RuntimeError(f"bucket {self.index} launched with unready parameters {self.unready_names()}")
        self.future = communicate(self)

    def launch_unconditionally(self, communicate: Callable[["Bucket"], torch.futures.Future]) -> None:
        """Launch whatever the buffer holds (a joined rank's zeros, see Reducer.shadow_backward)."""
        self.future = communicate(self)

    def wait(self) -> None:
        """Block until the communication finished; the result is in ``buffer`` (again: nothing to do)."""
        if self.done:
            return
        if self.future is None:
            raise RuntimeError(f"bucket {self.index} waited on before it was launched")
        result = self.future.wait()
        if isinstance(result, list):  # a Work's future yields the list of its tensors
            result = result[0]
        if result is not self.buffer and result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result)  # a comm hook may return a new tensor
        self.future, self.done = None, True

    def reset(self) -> None:
        self._ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.future, self.done = None, False

    # ----------------------------------------------------------- inspection
    @property
    def ready(self) -> bool:
        return self.pending == 0

    @property
    def launched(self) -> bool:
        return self.future is not None or self.done

    def unready_names(self) -> list[str]:
        return [n for n, r in zip(self.names, self._ready) if not r]

    def unready_indices(self) -> list[int]:
        return [i for i, r in zip(self.indices, self._ready) if not r]

