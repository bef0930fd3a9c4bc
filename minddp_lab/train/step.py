"""One optimizer step over ``K`` micro-batches (gradient accumulation), with optional clipping.

The gradient of a batch of ``K*b`` samples is the mean of the gradients of
its ``K`` micro-batches of ``b``: each micro-batch's loss is divided by ``K``
and the backward passes add up in ``.grad``. Only the last backward needs
the gradients all-reduced; the first ``K-1`` run inside the wrapper's
``no_sync()`` (``require_backward_grad_sync = False``), so a step costs one
round of all-reduces instead of ``K``. (BatchNorm is the exception to "the
same as a big batch": its statistics are over each micro-batch.)

Clipping comes after the last backward, on the all-reduced gradients (the
same on every rank, so every rank clips alike), and after the GradScaler
has unscaled them, so ``NORM`` is in the gradients' true units. Under ZeRO
(``--zero 1|2``) each rank holds only its shard of the averaged gradients:
the optimizer computes the global norm over the shards
(:func:`minddp_lab.train.optimizer.clip_gradients`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from minddp_lab.train.fully_sharded import is_fully_sharded, no_gradient_sync
from minddp_lab.train.optimizer import clip_gradients

__all__ = ["accumulated_step"]

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def accumulated_step(
    ddp_model: torch.nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    *,
    clip_grad: float | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Forward and backward every ``(images, labels)`` micro-batch, then one optimizer step.

    ``ddp_model`` is the wrapped model (MiniDDP or torch's DDP: both have
    ``no_sync``; under ``--zero 3`` the fully sharded model, which has
    FSDP2's ``set_requires_gradient_sync``); ``loss_fn(output, images,
    labels)`` a mean over its batch.
    Returns the step's loss (the mean over the micro-batches), detached.
    """
    k = len(micro_batches)
    device_type = micro_batches[0][0].device.type
    optimizer.zero_grad(set_to_none=True)
    step_loss = torch.zeros((), device=micro_batches[0][0].device)
    accumulating = no_gradient_sync if is_fully_sharded(ddp_model) else lambda m: m.no_sync()
    for i, (images, labels) in enumerate(micro_batches):
        last = i == k - 1
        with contextlib.nullcontext() if last else accumulating(ddp_model):
            with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                loss = loss_fn(ddp_model(images), images, labels)
            # Divided by k = 1 the loss is unchanged, bit for bit.
            scaler.scale(loss / k).backward()
        step_loss += loss.detach().float() / k
    if clip_grad is not None:
        scaler.unscale_(optimizer)
        clip_gradients(optimizer, clip_grad)
    scaler.step(optimizer)
    scaler.update()
    return step_loss
