"""One rank's training for ``minddp-train``: data, model, optimizer, the step loop, checkpoints.

Called with the process group already initialized. Exact resume is the design
constraint: training to step S in one go and training to step k, stopping and
resuming to S must give bit-identical parameters (on CPU). That needs the
checkpoint to hold, besides model, optimizer and GradScaler:

* the sampler epoch and how many batches of it were consumed: the sampler's
  order is a pure function of (seed, epoch, world size), so a resumed epoch
  rebuilds it and skips the consumed batches *by index*, without loading them;
* every rank's RNG states (torch, CUDA, Python ``random``), gathered to rank 0:
  ranks draw different dropout masks, so one rank's state is not enough.

Since the batch size is global, the number of batches consumed in an epoch
does not depend on the world size: a run can resume on a different number of
ranks and read the same samples in the same steps (only the RNG states then
cannot be restored, and a warning says so).

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

from minddp.checkpoint import LAST, CheckpointError, load_checkpoint, move_optimizer_state, save_checkpoint

__all__ = ["train"]

log = logging.getLogger("minddp.train")

# Arguments that change what a resumed run computes; a difference is warned about.
_RESUME_SENSITIVE = ("data", "synthetic_size", "batch_size", "lr", "lr_scaling", "seed", "amp", "sync_bn", "ddp")


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
    from minddp.data import SyntheticMNIST, make_dataset
    from minddp.train import UsageError

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


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_as_tuple(state["python"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _epoch_batches(loader, epoch: int, skip: int):
    """This epoch's loader, starting after ``skip`` consumed batches (skipped by index, never loaded).

    The sampler's order is a pure function of (seed, epoch, world size), so
    the consumed batches are known without reading them. The replacement
    loader shares the original's generator (the workers' base seed), which
    the checkpoint restores to its state at the start of the epoch.
    """
    loader.sampler.set_epoch(epoch)
    if skip == 0:
        return loader
    return torch.utils.data.DataLoader(
        loader.dataset,
        batch_sampler=list(loader.batch_sampler)[skip:],
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        generator=loader.generator,
    )


def _wrap(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    if args.ddp == "torch":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    from minddp import MiniDDP

    return MiniDDP(model)


def _convert_sync_bn(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    # torch's SyncBatchNorm only synchronizes on GPUs (it raises on CPU tensors),
    # so on CPU both --ddp choices use minddp's, which works on any device.
    if args.ddp == "torch" and device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    from minddp import SyncBatchNorm

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
    from minddp.data import make_loader
    from minddp.models import build_model, model_loss
    from minddp.train import UsageError

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

    step, epoch, batch_in_epoch = 0, 0, 0
    ckpt_path = os.path.join(args.checkpoint_dir, LAST) if args.checkpoint_dir else None
    if args.resume:
        state = load_checkpoint(ckpt_path, device, expect={"model_name": args.model})
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise CheckpointError(f"{ckpt_path} does not fit this model: {str(exc).splitlines()[0]}") from None
        needed = ("optimizer", "step", "epoch", "batch_in_epoch", "world_size", "rng", "args")
        missing = [k for k in needed if k not in state]
        if missing:
            raise CheckpointError(f"{ckpt_path} lacks {', '.join(missing)}: not written by minddp-train")
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:  # load_state_dict brought the saved lr back; this run's --lr rules
            group["lr"] = lr
        move_optimizer_state(optimizer, device)
        if state.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        changed = [k for k in _RESUME_SENSITIVE if state["args"].get(k) != getattr(args, k)]
        if changed:
            log.warning("warning: resuming with different %s than the checkpoint: not exact", ", ".join(changed))
        if state["world_size"] == world_size:
            _set_rng_state(state["rng"][rank], device)
            if loader.generator is not None and state["rng"][rank].get("loader") is not None:
                loader.generator.set_state(state["rng"][rank]["loader"].cpu())
        else:
            log.warning(
                "warning: checkpoint was written by %d ranks, resuming on %d: same data order, fresh RNG states",
                state["world_size"],
                world_size,
            )
        log.info("resumed from %s at step %d (epoch %d, batch %d)", ckpt_path, step, epoch + 1, batch_in_epoch)
        del state

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
        # Normalize "end of epoch e" to "start of epoch e+1": the resumed run then
        # does not build an empty epoch.
        e, b = (epoch + 1, 0) if batch_in_epoch == steps_per_epoch else (epoch, batch_in_epoch)
        rngs: list[Any] = [None] * world_size
        mine = _rng_state(device)
        mine["loader"] = epoch_start_generator  # to redraw this epoch's worker seeds on resume
        dist.all_gather_object(rngs, mine)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "step": step,
            "epoch": e,
            "batch_in_epoch": b,
            "world_size": world_size,
            "rng": rngs,
            "model_name": args.model,
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
        }
        save_checkpoint(state, args.checkpoint_dir, keep_step_copy=args.keep_checkpoints)
        if on_saved is not None:
            on_saved(step)

    window_loss = torch.zeros((), device=device)
    window_steps, window_start = 0, time.perf_counter()
    start, start_step, last_loss = time.perf_counter(), step, float("nan")
    saved_at = step if args.resume else -1
    while step < total_steps and epoch < args.epochs:
        generator = loader.generator
        epoch_start_generator = generator.get_state() if generator is not None else None
        for images, labels in _epoch_batches(loader, epoch, batch_in_epoch):
            if step >= total_steps:
                break
            fail_hook(step + 1)
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
                output = ddp_model(images)
                loss = model_loss(args.model, output, images, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            batch_in_epoch += 1
            window_loss += loss.detach().float()
            window_steps += 1

            if step % args.log_every == 0 or step == total_steps:
                # Every rank takes part (a collective); only rank 0 prints.
                dist.all_reduce(window_loss)
                last_loss = window_loss.item() / (window_steps * world_size)
                now = time.perf_counter()
                rate = window_steps * args.batch_size / max(now - window_start, 1e-9)
                eta = (total_steps - step) * (now - start) / max(step - start_step, 1)
                log.info(
                    "epoch %d/%d  step %d/%d  loss %.4f  %.0f samples/s  ETA %s",
                    epoch + 1,
                    args.epochs,
                    step,
                    total_steps,
                    last_loss,
                    rate,
                    _fmt_time(eta),
                )
                window_loss.zero_()
                window_steps, window_start = 0, now
            if args.checkpoint_dir and args.save_every and step % args.save_every == 0:
                save()
                saved_at = step
        else:
            epoch, batch_in_epoch = epoch + 1, 0
            continue
        break  # max steps reached inside the epoch
    if args.checkpoint_dir and saved_at != step:
        save()
    seconds = time.perf_counter() - start
    samples = (step - start_step) * args.batch_size
    log.info(
        "done: %d steps (%d this run) in %.1f s, %.0f samples/s, final loss %.4f%s",
        step,
        step - start_step,
        seconds,
        samples / max(seconds, 1e-9),
        last_loss,
        f", checkpoint {ckpt_path}" if ckpt_path else "",
    )
    return {"step": step, "epoch": epoch, "loss": last_loss, "seconds": seconds, "samples": samples}
