"""Which dtypes a unit computes and communicates in (torch FSDP2's ``MixedPrecisionPolicy``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: the dtype parameters are gathered and computed in (None: their own, fp32).

    ``reduce_dtype``: the dtype gradients are reduce-scattered in (None: ``param_dtype``,
    as FSDP2 does). Whatever these say, each rank's shard (what the optimizer
    steps, the "master weights") and its ``.grad`` stay in the parameters' own
    dtype: low precision is for the transient, full-size copies only.
    ``cast_forward_inputs``: floating-point tensors passed to a unit's forward
    are cast to ``param_dtype`` (so a float32 batch meets fp16 weights).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @classmethod
    def like(cls, policy) -> "MixedPrecisionPolicy":
        """Ours, from ours or from torch's ``MixedPrecisionPolicy`` (the same fields), so either import works."""
        if isinstance(policy, cls):
            return policy
        return cls(*(getattr(policy, name) for name in ("param_dtype", "reduce_dtype", "output_dtype",
                                                        "cast_forward_inputs")))

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        return self.param_dtype or master

    def communication_dtype(self, master: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype or master
