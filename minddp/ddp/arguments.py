"""MiniDDP's arguments, one by one, and their checks: a clear error naming the one at fault.

Arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``
(the file of each part in :mod:`minddp.ddp.parts` says more):

* ``process_group`` or a one-dimensional ``device_mesh``: the ranks to
  average over (default: the whole world).
* ``bucket_cap_mb``: gradients travel in flat buckets of at most this many
  MiB (the first one at most 1 MiB); 0 means one parameter per bucket;
  ``bucket_cap_mb_list``: one cap per bucket, in launch order (the last
  for every bucket after it). Caps chosen from the measured link and
  steps are the lab's: ``minddp_lab.auto.plan_buckets(ddp_model)``.
* ``forward_sync_buffers`` (torch 2.14's name; ``broadcast_buffers`` the
  older one): before each forward that follows a synchronized one,
  whatever its grad mode, and after a ``join``, copy rank 0's buffers
  (BatchNorm's running statistics) to every rank, read from the module
  each time. At construction too, unless ``broadcast_buffers=False``
  is given (torch's rule). ``buffer_sync`` is what MiniDDP reads.
* ``find_unused_parameters``: parameters that get no gradient on some
  rank count as zero there; without it such a parameter is an error at
  the end of backward, naming it. ``skip_all_reduce_unused_params``:
  with it, a promise that the unused ones stay the same on every rank.
* ``gradient_as_bucket_view``: each ``p.grad`` is a view into its bucket.
* ``device_ids``: the module's one device; the forward's inputs go there (``output_device``
  and ``dim``: kept, and without effect, as in torch's DDP with one device per process).
* ``init_sync``: at construction, check that every rank has the same parameters and copy rank
  0's values everywhere (default); False: the caller promises both.
* ``batched_grad_copy`` (torch 2.15): copy a bucket's gradients in and out in one batched call.
  MiniDDP always does (:meth:`minddp.ddp.core.buckets.Bucket.copy_in`); kept for torch's signature.
* ``lazy_bucket_allocation`` (torch 2.15): a bucket's buffer is allocated when its gradients
  are copied in, and freed once they are back in ``.grad``: no bucket memory between steps.
* ``check_reduction``: deprecated in torch, a ``FutureWarning`` here too.
* ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce`` and ``mixed_precision``
  (torch's internal and prototype options): refused with an error that says what to use instead.
* ``static_graph``: every iteration uses the same parameters the same
  number of times (lets a block run twice under a reentrant checkpoint).
* ``require_backward_grad_sync`` (attribute), ``no_sync()``: accumulate gradients locally.

Beyond torch's arguments:

* ``reduce_dtype``: reduce gradients in this dtype (e.g. float32 for bf16).
* ``buffer_sync``: ``"broadcast"`` (torch's way), ``"with_gradients"``
  (the same values, sent in the last gradient bucket: one collective fewer
  per step), ``"average"`` (floating-point buffers averaged over ranks) or
  ``"off"``; by default ``"broadcast"``, or ``"off"`` without ``forward_sync_buffers``.
* ``check_sync_every``: every N synchronized forwards, verify that the replicas are identical.
* ``timeline``: record when things happened in the last synchronized
  backward (``model.timeline``); ``trace``: record every hook and bucket
  for a Chrome trace (``model.tracer.export_chrome_trace(path)``).
* ``learn_bucket_order``: after the first synchronized backward, rebuild
  the buckets in the order gradients arrived (torch's DDP always does).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from minddp.ddp.core.assignment import FIRST_BUCKET_CAP_MB
from minddp.ddp.broadcast import BUFFER_POLICIES

__all__ = ["buffer_rule", "check_arguments", "first_bucket_cap_mb", "refuse_unsupported",
           "warn_broadcast_buffers_deprecated", "warn_check_reduction_deprecated"]


def check_arguments(buffer_sync: str, check_sync_every: int, bucket_cap_mb: Any, bucket_cap_mb_list: Any,
                     reduce_dtype: torch.dtype | None) -> None:
    if buffer_sync not in BUFFER_POLICIES:
        raise ValueError(f"buffer_sync must be one of {BUFFER_POLICIES}, got {buffer_sync!r}")
    if check_sync_every < 0:
        raise ValueError(f"check_sync_every must be >= 0 (0 = never), got {check_sync_every}")
    if bucket_cap_mb == "auto":  # the planner lives in the lab, which imports the library, never the reverse
        raise ValueError("MiniDDP(bucket_cap_mb='auto') is not the library's: build MiniDDP with the default cap, "
                         "then call minddp_lab.auto.plan_buckets(ddp_model) before the first backward")
    if isinstance(bucket_cap_mb, str):
        raise ValueError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}")
    if bucket_cap_mb is not None and bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 (0: one parameter per bucket), got {bucket_cap_mb}")
    if bucket_cap_mb_list is not None and (not bucket_cap_mb_list or any(cap < 0 for cap in bucket_cap_mb_list)):
        raise ValueError("bucket_cap_mb_list must be a non-empty list of MiB >= 0, one cap per bucket "
                         f"(the last one for every bucket after); got {bucket_cap_mb_list!r}")
    if reduce_dtype is not None and not reduce_dtype.is_floating_point:
        raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")


def buffer_rule(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """torch 2.14's buffer rule: (are buffers synchronized at forward and after a join, and at
    construction?) ``forward_sync_buffers`` says the first; the second is True too, unless the older
    ``broadcast_buffers=False`` alone asked for neither (deprecated: a ``FutureWarning``)."""
    if broadcast_buffers is not None:
        warn_broadcast_buffers_deprecated(forward_sync_buffers is not None, stacklevel=4)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    return broadcast_buffers is not False, broadcast_buffers is not False


def first_bucket_cap_mb(bucket_cap_mb: Any, bucket_cap_mb_list: Any, cap_mb: Any) -> Any:
    """torch's first bucket: 1 MiB (``FIRST_BUCKET_CAP_MB``) when no cap was given, else the cap itself."""
    given = bucket_cap_mb is not None or bucket_cap_mb_list is not None
    return cap_mb if given else FIRST_BUCKET_CAP_MB


def warn_broadcast_buffers_deprecated(forward_sync_buffers_given: bool, stacklevel: int = 3) -> None:
    """torch 2.13 deprecated ``broadcast_buffers`` for ``forward_sync_buffers``; MiniDDP warns as torch does."""
    if forward_sync_buffers_given:
        message = ("MiniDDP: both broadcast_buffers and forward_sync_buffers were given; broadcast_buffers is "
                   "deprecated (as in torch's DDP) and ignored")
    else:
        message = ("MiniDDP: broadcast_buffers is deprecated (as in torch's DDP); use forward_sync_buffers. "
                   "Unlike broadcast_buffers=False, forward_sync_buffers=False still copies rank 0's buffers "
                   "at construction: keep broadcast_buffers=False if each rank's buffers must stay its own")
    warnings.warn(message, FutureWarning, stacklevel=stacklevel)


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
