"""The wrappers the benchmark compares, and the hooks it gives them.

Four wrappers per row: torch's DDP and MiniDDP, each with
``gradient_as_bucket_view`` False (``copy``, both defaults) and True
(``view``). With ``--overhead`` (the default) four more, named ``..._nocomm``:
the same wrappers with :func:`return_bucket` as their communication hook.
And ``minddp_auto`` (unless ``--no-auto``): MiniDDP at its fastest, with
``plan_buckets`` and ``buffer_sync="with_gradients"``, set against
``torch_copy``, torch's DDP at *its* defaults.
"""

from __future__ import annotations

import torch

from minddp.ddp.core.assignment import MiB, TensorSpec, assign_buckets
from minddp.ddp.wrapper import FIRST_BUCKET_CAP_MB

NOCOMM = "_nocomm"  # suffix of the overhead-mode wrappers' names
AUTO = "minddp_auto"  # plan_buckets(MiniDDP(buffer_sync="with_gradients")), against torch_copy


def return_bucket(state, bucket):  # no annotation: torch's DDP rejects any but the unquoted Future[Tensor]
    """A communication hook that communicates nothing: the bucket, at once.

    The same function serves torch's DDP and MiniDDP (both pass a bucket with
    ``buffer()``). Both then skip their division by the world size (a hook
    averages), so each rank's ``.grad`` stays its local gradient.
    """
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def comm_hooks(name: str):
    """(torch's hook, MiniDDP's hook) for ``--comm-hook``; (None, None) for none.

    ``allreduce``: each wrapper's plain all-reduce as a hook. compare.py picks
    it at world size 1 (:func:`like_for_like_hook`).
    """
    if name == "none":
        return None, None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    from minddp.ddp import default_hooks as mh

    return {
        "allreduce": (dh.allreduce_hook, mh.allreduce_hook),
        "fp16": (dh.fp16_compress_hook, mh.fp16_compress_hook),
        "bf16": (dh.bf16_compress_hook, mh.bf16_compress_hook),
    }[name]


def wire_dtype(hook: str, dtype: torch.dtype) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(hook, dtype)


# torch's DDP at its defaults is bucket_cap_mb *not given*: buckets of 25 MiB, the first 1 MiB. A cap that is
# given, even 25, makes torch's first bucket the cap too (its _BucketCapacityConfig, torch 2.13 and on), and
# MiniDDP's as well: for every model here, one bucket. So the 25 MB row is torch's default: no cap given.
DEFAULT_CAP_MB = 25.0


def cap_argument(cap_mb: float) -> float | None:
    """What both wrappers are given as ``bucket_cap_mb`` for a row's cap: nothing for the default's row."""
    return None if cap_mb == DEFAULT_CAP_MB else cap_mb


def first_bucket_mb(cap_mb: float) -> float:
    """The first bucket's cap the wrappers build with at a row's cap: 1 MiB at the default, else the cap."""
    return FIRST_BUCKET_CAP_MB if cap_mb == DEFAULT_CAP_MB else cap_mb


def bucket_sizes(params: list[torch.Tensor], cap_mb: float) -> list[int]:
    """Element counts of the buckets the wrappers build (reverse order, the first bucket's cap, then cap)."""
    ordered = list(reversed(params))
    groups = assign_buckets([TensorSpec.of(p) for p in ordered], int(cap_mb * MiB), int(first_bucket_mb(cap_mb) * MiB))
    return [sum(ordered[i].numel() for i in group) for group in groups]


def wrapper_names(cfg: dict) -> list[str]:
    """``torch_copy``, ``minddp_copy``, ... for every measured setting, then the ``_nocomm`` ones."""
    names = [f"{impl}_{view}" for view in cfg["bucket_views"] for impl in ("torch", "minddp")]
    auto = [AUTO] if cfg.get("auto") and "copy" in cfg["bucket_views"] else []
    return names + auto + ([n + NOCOMM for n in names] if cfg["overhead"] else [])


WORLD_ONE_NOTE = (
    "note: world size 1: both wrappers get an all-reduce comm hook (torch's allreduce_hook, "
    "minddp.ddp.default_hooks.allreduce_hook), so both launch one real all-reduce per bucket; without it MiniDDP "
    "skips the collective (nothing to add up) while torch's DDP still runs it, and the two figures would "
    "not measure the same work"
)


def like_for_like_hook(hook: str, world_size: int) -> tuple[str, str | None]:
    """The hook both wrappers get, and a note saying why when it was changed.

    At world size 1 MiniDDP skips communication and torch's DDP does not;
    with the same all-reduce hook both communicate, so the two columns
    compare the same work.
    """
    if world_size == 1 and hook == "none":
        return "allreduce", WORLD_ONE_NOTE
    return hook, None
