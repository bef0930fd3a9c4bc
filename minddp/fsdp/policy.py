"""Which dtypes a unit computes and communicates in (torch FSDP2's ``MixedPrecisionPolicy``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "REDUCE_IN_PARAM_DTYPE_BY_DEFAULT"]

# With ``reduce_dtype=None``, FSDP2 up to torch 2.14 reduced gradients in ``param_dtype``; from
# torch 2.15 it reduces them in the parameters' own dtype (fp32 for fp32 parameters computed in
# bf16: its MixedPrecisionPolicy docstring, "versionchanged 2.15"). minddp follows the installed torch.
REDUCE_IN_PARAM_DTYPE_BY_DEFAULT = torch.__version__ < (2, 15)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: the dtype parameters are gathered and computed in (None: their own, fp32).

    ``reduce_dtype``: the dtype gradients are reduce-scattered in (None: as the installed
    torch's FSDP2 does, the parameters' own dtype from torch 2.15, ``param_dtype`` before:
    ``REDUCE_IN_PARAM_DTYPE_BY_DEFAULT``). Whatever these say, each rank's shard (what the optimizer
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
        if getattr(policy, "param_dtype_override_fn", None) is not None:
            raise ValueError(
                "minddp.fsdp.fully_shard: MixedPrecisionPolicy.param_dtype_override_fn (torch 2.15) is not "
                "supported: one unit computes in one dtype. Shard the parameters to keep in their own dtype "
                "as a unit of their own with a policy whose param_dtype is None")
        return cls(*(getattr(policy, name) for name in ("param_dtype", "reduce_dtype", "output_dtype",
                                                        "cast_forward_inputs")))

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        return self.param_dtype or master

    def communication_dtype(self, master: torch.dtype) -> torch.dtype:
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return (self.param_dtype or master) if REDUCE_IN_PARAM_DTYPE_BY_DEFAULT else master
