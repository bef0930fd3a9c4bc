"""Exact resume: what a training checkpoint holds besides the weights, and how a run continues from it.

The design constraint: training to step S in one go and training to step k,
stopping and resuming to S must give bit-identical parameters (on CPU). That
needs the checkpoint to hold, besides model, optimizer and GradScaler:

* the sampler epoch and how many batches of it were consumed: the sampler's
  order is a pure function of (seed, epoch, world size), so a resumed epoch
  rebuilds it and skips the consumed batches *by index*, without loading them;
* every rank's RNG states (torch, CUDA, Python ``random``), gathered to rank 0:
  ranks draw different dropout masks, so one rank's state is not enough.

Since the batch size is global, the number of batches consumed in an epoch
does not depend on the world size: a run can resume on a different number of
ranks and read the same samples in the same steps (only the RNG states then
cannot be restored, and a warning says so).

The optimizer's state is saved whole, in torch's format, even under ZeRO
(gathered to rank 0 by :func:`minddp_lab.train.optimizer.optimizer_state`): a
run can resume on another number of ranks, or with another ``--zero``, and
each rank's optimizer keeps the elements it owns.
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minddp_lab.train.checkpoint import CheckpointError, load_checkpoint, move_optimizer_state, save_checkpoint
from minddp_lab.train.fully_sharded import model_state_dict
from minddp_lab.train.optimizer import optimizer_state

__all__ = ["Parts", "Position", "load_weights", "restore_from", "save_for_resume", "epoch_batches"]

log = logging.getLogger("minddp_lab.train")

# Arguments that change what a resumed run computes; a difference is warned about.
_RESUME_SENSITIVE = (
    "data", "synthetic_size", "batch_size", "grad_accum", "clip_grad", "lr", "lr_scaling", "seed", "amp", "sync_bn", "ddp",
    "zero",
)
# What a checkpoint written before an argument existed ran with.
_ARG_DEFAULTS = {"zero": 0}


@dataclass
class Parts:
    """The pieces of one rank's training that a checkpoint saves or restores."""

    model: torch.nn.Module  # unwrapped: its state_dict keys carry no "module." prefix (sharded under --zero 3)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loader: torch.utils.data.DataLoader
    device: torch.device


@dataclass
class Position:
    """Where a run stands: optimizer steps in total, and loader batches consumed of the current epoch.

    With ``--grad-accum K`` a step consumes ``K`` batches, and a checkpoint is
    only ever written between steps, so ``batch_in_epoch`` is a multiple of ``K``.
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


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


def load_weights(path: str, args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """Read the checkpoint at ``path`` and load its weights into ``model``; return the rest for :func:`restore_from`.

    Called before the optimizer is built, so that it is built from the
    weights it will step: a ZeRO optimizer copies its piece of them when
    built (minddp.zero refreshes that copy at every step too, but nothing
    should rely on a copy that was stale for a while).
    """
    state = load_checkpoint(path, device, expect={"model_name": args.model})
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path} does not fit this model: {str(exc).splitlines()[0]}") from None
    needed = ("optimizer", "step", "epoch", "batch_in_epoch", "world_size", "rng", "args")
    missing = [k for k in needed if k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: not written by minddp-train")
    return state


def restore_from(
    state: dict[str, Any], path: str, args: argparse.Namespace, parts: Parts, lr: float, rank: int, world_size: int
) -> Position:
    """Load the rest of ``state`` (read by :func:`load_weights`) into ``parts`` (this run's ``lr`` wins);
    return where the saved run stood."""
    parts.optimizer.load_state_dict(state["optimizer"])
    for group in parts.optimizer.param_groups:  # load_state_dict brought the saved lr back; this run's --lr rules
        group["lr"] = lr
    move_optimizer_state(parts.optimizer, parts.device)
    if state.get("scaler") and parts.scaler.is_enabled():
        parts.scaler.load_state_dict(state["scaler"])
    position = Position(state["step"], state["epoch"], state["batch_in_epoch"])
    changed = [k for k in _RESUME_SENSITIVE if state["args"].get(k, _ARG_DEFAULTS.get(k)) != getattr(args, k)]
    if changed:
        log.warning("warning: resuming with different %s than the checkpoint: not exact", ", ".join(changed))
    if state["world_size"] == world_size:
        _set_rng_state(state["rng"][rank], parts.device)
        generator = parts.loader.generator
        if generator is not None and state["rng"][rank].get("loader") is not None:
            generator.set_state(state["rng"][rank]["loader"].cpu())
    else:
        log.warning(
            "warning: checkpoint was written by %d ranks, resuming on %d: same data order, fresh RNG states",
            state["world_size"],
            world_size,
        )
    log.info(
        "resumed from %s at step %d (epoch %d, batch %d)",
        path, position.step, position.epoch + 1, position.batch_in_epoch,
    )
    return position


def save_for_resume(
    args: argparse.Namespace,
    parts: Parts,
    position: Position,
    batches_per_epoch: int,
    world_size: int,
    epoch_start_generator: torch.Tensor | None,
) -> None:
    """Write a checkpoint of this run (every rank calls it: the RNG states are gathered)."""
    # Normalize "end of epoch e" to "start of epoch e+1": the resumed run then
    # does not build an empty epoch.
    if position.batch_in_epoch == batches_per_epoch:
        epoch, batch = position.epoch + 1, 0
    else:
        epoch, batch = position.epoch, position.batch_in_epoch
    rngs: list[Any] = [None] * world_size
    mine = _rng_state(parts.device)
    mine["loader"] = epoch_start_generator  # to redraw this epoch's worker seeds on resume
    dist.all_gather_object(rngs, mine)
    state = {
        "model": model_state_dict(parts.model),  # whole, even when sharded (a collective then)
        "optimizer": optimizer_state(parts.optimizer, dist.get_rank()),  # whole, even when sharded
        "scaler": parts.scaler.state_dict() if parts.scaler.is_enabled() else None,
        "step": position.step,
        "epoch": epoch,
        "batch_in_epoch": batch,
        "world_size": world_size,
        "rng": rngs,
        "model_name": args.model,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
    }
    save_checkpoint(state, args.checkpoint_dir, keep_step_copy=args.keep_checkpoints)


def epoch_batches(loader: torch.utils.data.DataLoader, epoch: int, skip: int):
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
