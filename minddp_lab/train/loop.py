"""One rank's training for ``minddp-train``: data, model, optimizer, the step loop, evaluation, checkpoints.

Called with the process group already initialized. What a checkpoint holds
for an exact resume, and how a resumed run finds its place, is in
:mod:`minddp_lab.train.resume`; one optimizer step (gradient accumulation,
clipping) in :mod:`minddp_lab.train.step`; the held-out evaluation in
:mod:`minddp_lab.train.evaluate`; the parts built from the command line (and the
failure hook the tests use) in :mod:`minddp_lab.train.setup`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import random
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from minddp_lab.data import make_loader
from minddp_lab.models import build_model, model_loss
from minddp_lab.train.checkpoint import LAST
from minddp_lab.train.errors import UsageError
from minddp_lab.train.evaluate import Evaluation, evaluate, held_out_loader
from minddp_lab.train.fully_sharded import whole_copy
from minddp_lab.train.metrics import MetricsLog
from minddp_lab.train.optimizer import build_optimizer, describe_zero
from minddp_lab.train.resume import Parts, Position, epoch_batches, load_weights, restore_from, save_for_resume
from minddp_lab.train.setup import convert_sync_bn, failure_hook, held_out_set, pick_device, training_set, wrap
from minddp_lab.train.step import accumulated_step

__all__ = ["train"]

log = logging.getLogger("minddp_lab.train")


def _setup_logging(rank: int) -> None:
    # Rank 0 talks; the others only report errors (through the parent or their launcher).
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[minddp] %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.ERROR)


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _resume_wanted(args: argparse.Namespace, ckpt_path: str | None, device: torch.device) -> bool:
    """``--resume``: yes. ``--resume auto``: when ``last.pt`` exists (rank 0 looks; every rank follows)."""
    if args.resume != "auto":
        return bool(args.resume)
    # Rank 0 decides for all: on a shared file system ranks on other nodes
    # may see a new file a moment later, and all must take the same road.
    found = torch.tensor([float(os.path.exists(ckpt_path))], device=device)
    dist.broadcast(found, src=0)
    if not found.item():
        log.info("no checkpoint at %s yet: starting fresh", ckpt_path)
    return bool(found.item())


def _header(args: argparse.Namespace, world_size: int, amp_dtype: torch.dtype, steps_per_epoch: int, lr: float) -> str:
    batch = f"global batch {args.batch_size} ({args.batch_size // world_size} per rank)"
    if args.grad_accum > 1:
        batch += f" x {args.grad_accum} accumulated = effective global batch {args.batch_size * args.grad_accum}"
    amp = f", amp {str(amp_dtype).removeprefix('torch.')}" if args.amp else ""
    ranks = f"{world_size} rank{'' if world_size == 1 else 's'}"
    clip = f", gradients clipped to norm {args.clip_grad:g}" if args.clip_grad else ""
    return (
        f"{args.model} on {args.data}, {ranks} ({args.ddp}, {args.backend}{amp}), {batch}, "
        f"{steps_per_epoch} steps/epoch, lr {lr:g}{clip}{describe_zero(args.zero, world_size)}"
    )


def _fresh_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """An untrained model of the run's architecture (its weights are about to be replaced)."""
    model = build_model(args.model)
    return convert_sync_bn(model, args, device) if args.sync_bn else model


def train(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    local_rank: int,
    on_saved: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train on this rank; return a summary (the same on every rank except timings)."""
    _setup_logging(rank)
    fail_hook = failure_hook(rank)
    device = pick_device(args, local_rank)

    # Same initial model on every rank (the wrapper broadcasts rank 0's anyway).
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    loader = make_loader(
        training_set(args),
        args.batch_size,
        shuffle=True,
        seed=args.seed,
        drop_last=True,
        num_workers=args.workers,
        rank=rank,
        world_size=world_size,
    )
    accum = args.grad_accum
    steps_per_epoch = len(loader) // accum  # a last group of fewer than accum batches is left out
    batches_per_epoch = steps_per_epoch * accum
    if steps_per_epoch == 0:
        raise UsageError(
            f"{len(loader.dataset)} training samples do not fill one step of {accum} x {args.batch_size} samples"
        )
    held_out = held_out_loader(held_out_set(args), args.batch_size, rank, world_size, args.workers)
    model = build_model(args.model)
    if args.sync_bn:
        model = convert_sync_bn(model, args, device)
    model.to(device)
    lr = args.lr * (world_size if args.lr_scaling == "linear" else 1)
    ckpt_path = os.path.join(args.checkpoint_dir, LAST) if args.checkpoint_dir else None
    resuming = _resume_wanted(args, ckpt_path, device)
    # Order matters: the weights first, then the wrapper (ZeRO hooks into it),
    # then the optimizer (ZeRO copies its piece of the weights when built).
    saved = load_weights(ckpt_path, args, model, device) if resuming else None
    ddp_model = wrap(model, args, device)  # under --zero 3, model itself, sharded
    optimizer = build_optimizer(model, ddp_model, args, lr)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    autocast_dtype = amp_dtype if args.amp else None
    # Loss scaling exists for float16's narrow range; bfloat16 has float32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and amp_dtype == torch.float16)

    # Different ranks draw different random numbers (dropout masks), reproducibly.
    torch.manual_seed(args.seed + 7919 * (rank + 1))
    random.seed(args.seed + 7919 * (rank + 1))

    parts = Parts(model, optimizer, scaler, loader, device)
    pos = restore_from(saved, ckpt_path, args, parts, lr, rank, world_size) if saved is not None else Position()
    metrics = MetricsLog(args.checkpoint_dir, rank, pos.step if resuming else None)

    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    log.info("%s", _header(args, world_size, amp_dtype, steps_per_epoch, lr))
    step = functools.partial(
        accumulated_step,
        ddp_model,
        loss_fn=functools.partial(model_loss, args.model),
        optimizer=optimizer,
        scaler=scaler,
        clip_grad=args.clip_grad,
        autocast_dtype=autocast_dtype,
    )

    def save() -> None:
        save_for_resume(args, parts, pos, batches_per_epoch, world_size, epoch_start_generator)
        if on_saved is not None:
            on_saved(pos.step)

    def validate() -> Evaluation:
        build = functools.partial(_fresh_model, args, device)
        result = evaluate(whole_copy(model, build, device), args.model, held_out, device, autocast_dtype)
        accuracy = f"  accuracy {100 * result.accuracy:.2f}%" if result.accuracy is not None else ""
        log.info(
            "epoch %d/%d  step %d  validation loss %.4f%s  (%d held-out samples)",
            pos.epoch + 1, args.epochs, pos.step, result.loss, accuracy, result.samples,
        )
        metrics.write(step=pos.step, epoch=pos.epoch + 1, val_loss=result.loss, val_accuracy=result.accuracy)
        return result

    window_loss = torch.zeros((), device=device)
    window_steps, window_start = 0, time.perf_counter()
    start, start_step, last_loss, last_eval = time.perf_counter(), pos.step, float("nan"), None
    saved_at = pos.step if resuming else -1
    while pos.step < total_steps and pos.epoch < args.epochs:
        generator = loader.generator
        epoch_start_generator = generator.get_state() if generator is not None else None
        batches = iter(epoch_batches(loader, pos.epoch, pos.batch_in_epoch))
        while pos.batch_in_epoch < batches_per_epoch and pos.step < total_steps:
            fail_hook(pos.step + 1)
            micro_batches = [
                tuple(t.to(device, non_blocking=True) for t in next(batches)) for _ in range(accum)
            ]
            window_loss += step(micro_batches)
            pos.step += 1
            pos.batch_in_epoch += accum
            window_steps += 1

            if pos.step % args.log_every == 0 or pos.step == total_steps:
                # Every rank takes part (a collective); only rank 0 prints.
                dist.all_reduce(window_loss)
                last_loss = window_loss.item() / (window_steps * world_size)
                now = time.perf_counter()
                rate = window_steps * args.batch_size * accum / max(now - window_start, 1e-9)
                eta = (total_steps - pos.step) * (now - start) / max(pos.step - start_step, 1)
                log.info(
                    "epoch %d/%d  step %d/%d  loss %.4f  %.0f samples/s  ETA %s",
                    pos.epoch + 1, args.epochs, pos.step, total_steps, last_loss, rate, _fmt_time(eta),
                )
                metrics.write(step=pos.step, epoch=pos.epoch + 1, loss=last_loss, samples_per_s=rate)
                window_loss.zero_()
                window_steps, window_start = 0, now
            # Evaluated before a save at the same step, so a run resumed from
            # that checkpoint does not lack (or repeat) this evaluation.
            if pos.batch_in_epoch == batches_per_epoch or pos.step == total_steps:
                last_eval = validate()
            if args.checkpoint_dir and args.save_every and pos.step % args.save_every == 0:
                save()
                saved_at = pos.step
        if pos.batch_in_epoch == batches_per_epoch:
            pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
    if args.checkpoint_dir and saved_at != pos.step:
        save()
    seconds = time.perf_counter() - start
    samples = (pos.step - start_step) * args.batch_size * accum
    log.info(
        "done: %d steps (%d this run) in %.1f s, %.0f samples/s, final loss %.4f%s",
        pos.step,
        pos.step - start_step,
        seconds,
        samples / max(seconds, 1e-9),
        last_loss,
        f", checkpoint {ckpt_path}" if ckpt_path else "",
    )
    summary = {"step": pos.step, "epoch": pos.epoch, "loss": last_loss, "seconds": seconds, "samples": samples}
    if last_eval is not None:
        summary.update(val_loss=last_eval.loss, val_accuracy=last_eval.accuracy)
    return summary
