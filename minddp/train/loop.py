"""One rank's training for ``minddp-train``: data, model, optimizer, the step loop, checkpoints.

Called with the process group already initialized. What a checkpoint holds
for an exact resume, and how a resumed run finds its place, is in
:mod:`minddp.train.resume`.

Test hook: ``MINDDP_TEST_FAIL=RANK:STEP:HOW`` makes rank ``RANK`` fail just
before step ``STEP`` (1-based), ``HOW`` being ``kill`` (SIGKILL itself),
``raise`` (a RuntimeError) or ``exit`` (``os._exit(3)``). Only the tests use it.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from minddp.data import SyntheticMNIST, make_dataset, make_loader
from minddp.ddp import MiniDDP
from minddp.models import build_model, model_loss
from minddp.sync_batchnorm import SyncBatchNorm
from minddp.train.checkpoint import LAST
from minddp.train.errors import UsageError
from minddp.train.resume import Parts, Position, epoch_batches, restore_from, save_for_resume

__all__ = ["train"]

log = logging.getLogger("minddp.train")

def _setup_logging(rank: int) -> None:
    # Rank 0 talks; the others only report errors (through the parent or their launcher).
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[minddp] %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.ERROR)


def _test_hook(rank: int) -> Callable[[int], None]:
    spec = os.environ.get("MINDDP_TEST_FAIL")
    if not spec:
        return lambda step: None
    fail_rank, fail_step, how = spec.split(":")
    if int(fail_rank) != rank:
        return lambda step: None

    def hook(step: int) -> None:
        if step != int(fail_step):
            return
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"MINDDP_TEST_FAIL: rank {rank} fails before step {step} on purpose")

    return hook


def _dataset(args: argparse.Namespace):
    if args.data == "synthetic":
        return SyntheticMNIST(size=args.synthetic_size, seed=args.seed, train=True)
    try:
        # With --download, rank 0 fetches while the others wait at a barrier.
        return make_dataset("mnist", root=args.data_dir, train=True, download=args.download)
    except (RuntimeError, OSError) as exc:  # its message says what is missing and how to get it
        raise UsageError(str(exc).strip().replace("\n", " ")) from None


def _device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if args.backend == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _wrap(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    if args.ddp == "torch":
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    return MiniDDP(model)


def _convert_sync_bn(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    # torch's SyncBatchNorm only synchronizes on GPUs (it raises on CPU tensors),
    # so on CPU both --ddp choices use minddp's, which works on any device.
    if args.ddp == "torch" and device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return SyncBatchNorm.convert_sync_batchnorm(model)


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    local_rank: int,
    on_saved: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train on this rank; return a summary (the same on every rank except timings)."""
    _setup_logging(rank)
    fail_hook = _test_hook(rank)
    device = _device(args, local_rank)

    # Same initial model on every rank (the wrapper broadcasts rank 0's anyway).
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    loader = make_loader(
        _dataset(args),
        args.batch_size,
        shuffle=True,
        seed=args.seed,
        drop_last=True,
        num_workers=args.workers,
        rank=rank,
        world_size=world_size,
    )
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise UsageError(f"{len(loader.dataset)} training samples do not fill one global batch of {args.batch_size}")
    model = build_model(args.model)
    if args.sync_bn:
        model = _convert_sync_bn(model, args, device)
    model.to(device)
    lr = args.lr * (world_size if args.lr_scaling == "linear" else 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    use_amp = args.amp
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    # Loss scaling exists for float16's narrow range; bfloat16 has float32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp and amp_dtype == torch.float16)

    # Different ranks draw different random numbers (dropout masks), reproducibly.
    torch.manual_seed(args.seed + 7919 * (rank + 1))
    random.seed(args.seed + 7919 * (rank + 1))

    parts = Parts(model, optimizer, scaler, loader, device)
    ckpt_path = os.path.join(args.checkpoint_dir, LAST) if args.checkpoint_dir else None
    pos = restore_from(ckpt_path, args, parts, lr, rank, world_size) if args.resume else Position()

    ddp_model = _wrap(model, args, device)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    log.info(
        "%s on %s, %d rank%s (%s, %s%s), global batch %d (%d per rank), %d steps/epoch, lr %g",
        args.model,
        args.data,
        world_size,
        "" if world_size == 1 else "s",
        args.ddp,
        args.backend,
        f", amp {str(amp_dtype).removeprefix('torch.')}" if use_amp else "",
        args.batch_size,
        args.batch_size // world_size,
        steps_per_epoch,
        lr,
    )

    def save() -> None:
        save_for_resume(args, parts, pos, steps_per_epoch, world_size, epoch_start_generator)
        if on_saved is not None:
            on_saved(pos.step)

    window_loss = torch.zeros((), device=device)
    window_steps, window_start = 0, time.perf_counter()
    start, start_step, last_loss = time.perf_counter(), pos.step, float("nan")
    saved_at = pos.step if args.resume else -1
    while pos.step < total_steps and pos.epoch < args.epochs:
        generator = loader.generator
        epoch_start_generator = generator.get_state() if generator is not None else None
        for images, labels in epoch_batches(loader, pos.epoch, pos.batch_in_epoch):
            if pos.step >= total_steps:
                break
            fail_hook(pos.step + 1)
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
                output = ddp_model(images)
                loss = model_loss(args.model, output, images, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            pos.step += 1
            pos.batch_in_epoch += 1
            window_loss += loss.detach().float()
            window_steps += 1

            if pos.step % args.log_every == 0 or pos.step == total_steps:
                # Every rank takes part (a collective); only rank 0 prints.
                dist.all_reduce(window_loss)
                last_loss = window_loss.item() / (window_steps * world_size)
                now = time.perf_counter()
                rate = window_steps * args.batch_size / max(now - window_start, 1e-9)
                eta = (total_steps - pos.step) * (now - start) / max(pos.step - start_step, 1)
                log.info(
                    "epoch %d/%d  step %d/%d  loss %.4f  %.0f samples/s  ETA %s",
                    pos.epoch + 1,
                    args.epochs,
                    pos.step,
                    total_steps,
                    last_loss,
                    rate,
                    _fmt_time(eta),
                )
                window_loss.zero_()
                window_steps, window_start = 0, now
            if args.checkpoint_dir and args.save_every and pos.step % args.save_every == 0:
                save()
                saved_at = pos.step
        else:
            pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
            continue
        break  # max steps reached inside the epoch
    if args.checkpoint_dir and saved_at != pos.step:
        save()
    seconds = time.perf_counter() - start
    samples = (pos.step - start_step) * args.batch_size
    log.info(
        "done: %d steps (%d this run) in %.1f s, %.0f samples/s, final loss %.4f%s",
        pos.step,
        pos.step - start_step,
        seconds,
        samples / max(seconds, 1e-9),
        last_loss,
        f", checkpoint {ckpt_path}" if ckpt_path else "",
    )
    return {"step": pos.step, "epoch": pos.epoch, "loss": last_loss, "seconds": seconds, "samples": samples}
