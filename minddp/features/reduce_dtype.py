"""``reduce_dtype``: reduce gradients in another dtype than the parameters' (e.g. float32 for bf16).

The buckets hold ``reduce_dtype``; gradients are cast into them (cast
first, then scaled: one rounding, see ``Bucket.copy_in``) and the averages
cast back into ``.grad``. Twice the bytes of bf16 on the wire, one rounding
at the end instead of one per addition. (torch: FSDP's
``mixed_precision.reduce_dtype``; DDP's ``_MixedPrecision``.)
"""

from __future__ import annotations

import torch

from minddp.features import Layer

__all__ = ["ReduceDtype"]


class ReduceDtype(Layer):
    height = 2

    def attach(self, dtype: torch.dtype) -> None:
        self._reduce_dtype = dtype
        self._build_buckets(self.layout_order)

    def bucket_dtype(self, index: int) -> torch.dtype:
        return self._reduce_dtype
