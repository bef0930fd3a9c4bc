"""What a bucket's communication is: plain all-reduce, or a compressed one.

A communication hook follows torch's contract, so hooks written for torch's
DDP run on MiniDDP unchanged (``torch.distributed.algorithms.ddp_comm_hooks``
included)::

    def hook(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]

``bucket.buffer()`` holds this rank's gradients, *not* divided by the world
size: with a hook registered MiniDDP leaves the averaging to the hook. The
future's value (a tensor shaped like the buffer) is what lands in ``.grad``.

Why compress? On a communication-bound model, halving the bytes roughly
halves the all-reduce time. The price is fp16's rounding (about 3 decimal
digits) and range: dividing by the world size *before* the sum keeps the sum
from overflowing. bf16 keeps fp32's range and has even less precision.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist

from minddp.ddp.core.buckets import Bucket

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "check_comm_hook",
           "builtin_comm_hook"]


class GradBucket:
    """The view of a :class:`~minddp.ddp.core.buckets.Bucket` that a comm hook sees (torch's API)."""

    def __init__(self, bucket: Bucket, num_buckets: int):
        self._bucket = bucket
        self._num_buckets = num_buckets

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def is_last(self) -> bool:
        return self._bucket.index == self._num_buckets - 1

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor)


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket exactly: divide by the world size, then sum."""
    group = _group(process_group)
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _compress_hook(dtype: torch.dtype, process_group, bucket: GradBucket) -> torch.futures.Future:
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        # Back into the original buffer: no second full-size tensor alive.
        return buffer.copy_(f.value()[0])

    return fut.then(decompress)


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce in float16: half the bytes, about 3 significant digits."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce in bfloat16: half the bytes, float32's range, about 2 significant digits."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


def check_comm_hook(hook: Callable) -> None:
    """The checks torch's DDP makes when a hook is registered, with its words.

    A hook must be callable; if it annotates ``bucket``, the annotation names
    a ``GradBucket`` (torch's ``dist.GradBucket`` or this module's); if it
    annotates its return, a ``Future``. (Annotations may be strings, under
    ``from __future__ import annotations``.)
    """
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. Got {type(hook).__name__}")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin: nothing to read
        return
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation is not inspect.Parameter.empty \
            and "GradBucket" not in _annotation_name(bucket.annotation):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket, "
                         f"got {_annotation_name(bucket.annotation)}")
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and "Future" not in _annotation_name(returned):
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor], "
                         f"got {_annotation_name(returned)}")


def _annotation_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))


def builtin_comm_hook(comm_hook_type: dist.BuiltinCommHookType) -> Callable:
    """This module's hook for torch's ``dist.BuiltinCommHookType`` (``register_builtin_comm_hook``)."""
    hooks = {dist.BuiltinCommHookType.ALLREDUCE: allreduce_hook,
             dist.BuiltinCommHookType.FP16_COMPRESS: fp16_compress_hook}
    if comm_hook_type not in hooks:
        raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}; known: {list(hooks)}")
    return hooks[comm_hook_type]
