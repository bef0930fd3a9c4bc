"""MiniDDP's arguments checked before anything is built: a clear error naming the one at fault."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from minddp.sync import BUFFER_POLICIES

__all__ = ["check_arguments", "refuse_unsupported", "warn_broadcast_buffers_deprecated",
           "warn_check_reduction_deprecated"]


def check_arguments(buffer_sync: str, check_sync_every: int, bucket_cap_mb: Any, bucket_cap_mb_list: Any,
                     reduce_dtype: torch.dtype | None) -> None:
    if buffer_sync not in BUFFER_POLICIES:
        raise ValueError(f"buffer_sync must be one of {BUFFER_POLICIES}, got {buffer_sync!r}")
    if check_sync_every < 0:
        raise ValueError(f"check_sync_every must be >= 0 (0 = never), got {check_sync_every}")
    auto_buckets = isinstance(bucket_cap_mb, str)
    if auto_buckets and bucket_cap_mb != "auto":
        raise ValueError(f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}")
    if not auto_buckets and bucket_cap_mb is not None and bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 (0: one parameter per bucket), got {bucket_cap_mb}")
    if bucket_cap_mb_list is not None and (auto_buckets or not bucket_cap_mb_list
                                           or any(cap < 0 for cap in bucket_cap_mb_list)):
        raise ValueError("bucket_cap_mb_list must be a non-empty list of MiB >= 0, one cap per bucket "
                         f"(the last one for every bucket after), without bucket_cap_mb='auto'; got "
                         f"{bucket_cap_mb_list!r}")
    if reduce_dtype is not None and not reduce_dtype.is_floating_point:
        raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")


def warn_broadcast_buffers_deprecated(forward_sync_buffers_given: bool) -> None:
    """torch 2.13 deprecated ``broadcast_buffers`` for ``forward_sync_buffers``; MiniDDP warns as torch does."""
    if forward_sync_buffers_given:
        message = ("MiniDDP: both broadcast_buffers and forward_sync_buffers were given; broadcast_buffers is "
                   "deprecated (as in torch's DDP) and ignored")
    else:
        message = ("MiniDDP: broadcast_buffers is deprecated (as in torch's DDP); use forward_sync_buffers. "
                   "Unlike broadcast_buffers=False, forward_sync_buffers=False still copies rank 0's buffers "
                   "at construction: keep broadcast_buffers=False if each rank's buffers must stay its own")
    warnings.warn(message, FutureWarning, stacklevel=3)


def refuse_unsupported(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any, mixed_precision: Any,
                       lazy_bucket_views: bool) -> None:
    """torch's DDP arguments MiniDDP does not implement: each refused by name, with what to use instead."""
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise NotImplementedError(
            "MiniDDP does not take delay_all_reduce_named_params / param_to_hook_all_reduce (torch's DDP "
            "launches those parameters' all-reduce, unawaited, from another parameter's hook). Leave them out "
            "with MiniDDP._set_params_and_buffers_to_ignore_for_model(module, names) and all-reduce their "
            "gradients yourself")
    if mixed_precision is not None:
        raise NotImplementedError(
            "MiniDDP does not take torch's prototype mixed_precision config: compute in low precision with "
            "torch.autocast, or keep bf16/fp16 parameters and reduce their gradients in float32 with "
            "MiniDDP(..., reduce_dtype=torch.float32)")
    if lazy_bucket_views:
        raise ValueError(
            "lazy_bucket_allocation=True and gradient_as_bucket_view=True cannot go together in MiniDDP: "
            "each .grad would be a view into a bucket freed after backward")


def warn_check_reduction_deprecated() -> None:
    """torch's DDP warns, and ignores it: every reduction finishes or raises anyway."""
    warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                  "Please avoid using it.", FutureWarning, stacklevel=3)
