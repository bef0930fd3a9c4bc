"""``minddp-train``: train an MNIST model with MiniDDP (or torch's DDP), on one machine or many.

How it starts, in order of precedence:

* ``--nproc N`` given: spawn ``N`` local processes (any launcher variables in
  the environment are ignored). This is what you run on a laptop.
* Under ``torchrun``, ``srun`` or ``mpirun`` (and no ``--nproc``): this process
  is one rank; rank and world size come from the launcher
  (:func:`minddp.launch.detect_launch`). See ``scripts/`` for the commands.
* Neither: spawn 2 local processes.

The files behind it: this one parses and checks the command line and reports
failures; :mod:`minddp_lab.train.loop` is one rank's training;
:mod:`minddp_lab.train.local` starts local ranks and tells which one failed first.

Exit codes: 0 done, 1 a rank failed, 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

from minddp.launch import detect_launch, find_free_port, init_distributed, shutdown
from minddp_lab.train.checkpoint import LAST, CheckpointError
from minddp_lab.train.errors import UsageError, describe_exception, is_communication_error
from minddp_lab.train.local import run_local
from minddp_lab.train.loop import train
from minddp_lab.train.optimizer import ZERO_STAGES

__all__ = ["main", "build_parser", "UsageError", "check_args"]

PROG = "minddp-train"
# Environment variables that mean "a launcher started this process".
_LAUNCHER_VARS = ("RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a default worth reading (not for switches and unset options)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train an MNIST model on several processes at once (data parallel) with MiniDDP or torch's DDP. "
        "The loss is printed as it trains, and after every epoch the validation loss (and accuracy) on held-out "
        "images. Checkpoints survive a crash and resume exactly.",
        formatter_class=_HelpFormatter,
    )
    a = p.add_argument
    a("--model", choices=["cnn", "resnet", "mlp", "ae"], default="cnn",
      help="what to train: cnn, a small convolutional classifier (fast, learns in one epoch); resnet, a "
           "residual classifier; mlp, a wide fully connected classifier (5 M parameters, so mostly "
           "communication); ae, an autoencoder that learns to redraw its input (no labels, no accuracy)")
    a("--data", choices=["synthetic", "mnist"], default="synthetic",
      help="synthetic: MNIST-like digits made up from --seed, no files or network needed; "
           "mnist: the real MNIST from --data-dir (its 10000 test images are the held-out set)")
    a("--data-dir", default=None, metavar="DIR", help="the folder that holds MNIST (DIR/MNIST/raw), or will with --download")
    a("--download", action="store_true", help="download MNIST into --data-dir first (rank 0 fetches, the others wait)")
    a("--synthetic-size", type=int, default=2048, metavar="N",
      help="how many synthetic training images; a quarter as many more are held out for validation")
    a("--ddp", choices=["mini", "torch"], default="mini",
      help="which data-parallel wrapper: mini (this package's MiniDDP) or torch (torch's DistributedDataParallel)")
    a("--nproc", type=int, default=None, metavar="N",
      help="start this many training processes on this machine (2 when no launcher such as torchrun, "
           "srun or mpirun started this one; never give it under a launcher)")
    a("--backend", choices=["gloo", "nccl"], default="gloo",
      help="how the processes talk: gloo works on CPU; nccl needs one CUDA GPU per process and is faster there")
    a("--epochs", type=int, default=1, metavar="N", help="how many times to go through the training set")
    a("--max-steps", type=int, default=None, metavar="N",
      help="stop after this many optimizer steps in total (counting those before a resume), even mid-epoch")
    a("--batch-size", type=int, default=64, metavar="N",
      help="samples per forward pass over ALL processes together (each process takes an equal share)")
    a("--grad-accum", type=int, default=1, metavar="K",
      help="gradient accumulation: add up the gradients of K batches before each optimizer step, so a step "
           "sees K x --batch-size samples (the effective batch) with the memory of one batch; gradients are "
           "exchanged between processes once per step, not once per batch")
    a("--lr", type=float, default=0.01, help="learning rate of the SGD optimizer (momentum 0.9)")
    a("--lr-scaling", choices=["none", "linear"], default="none",
      help="linear: multiply --lr by the number of processes (the linear scaling rule, taking --lr as tuned for one)")
    a("--zero", type=int, choices=ZERO_STAGES, default=0, metavar="{0,1,2,3}",
      help="ZeRO: shard what every rank would otherwise keep whole. 0: off (every rank keeps all of the "
           "optimizer state); 1: each rank keeps and updates 1/N of the optimizer state (SGD's momentum), "
           "then the parameters are all-gathered; 2: also 1/N of the gradients, which MiniDDP "
           "reduce-scatters bucket by bucket during backward instead of all-reducing (needs --ddp mini); 3: also "
           "1/N of the parameters (minddp.fsdp.fully_shard on each layer, then the model, instead of DDP). "
           "Checkpoints hold the whole optimizer state (gathered on rank 0), so a run resumes on any number "
           "of ranks and with any --zero")
    a("--clip-grad", type=float, default=None, metavar="NORM",
      help="scale the gradients down whenever their total norm exceeds NORM (gradient clipping; off by default)")
    a("--amp", action="store_true", help="mixed precision: bfloat16 on CPU, float16 with loss scaling on CUDA")
    a("--sync-bn", action="store_true",
      help="compute BatchNorm statistics over the whole global batch instead of each process's share (SyncBatchNorm)")
    a("--checkpoint-dir", default=None, metavar="DIR",
      help="save the run here: last.pt (written atomically, so a crash never leaves half a file) and metrics.jsonl")
    a("--save-every", type=int, default=0, metavar="STEPS",
      help="also save a checkpoint every this many steps (0: only at the end); a crash loses at most that many")
    a("--keep-checkpoints", action="store_true", help="keep a copy of every checkpoint as step-N.pt beside last.pt")
    a("--resume", nargs="?", const="always", choices=["always", "auto"], default=None, metavar="auto",
      help="--resume: continue exactly where --checkpoint-dir/last.pt stopped (an error if there is none). "
           "--resume auto: continue if last.pt exists, start fresh if not; give it to a job that may be "
           "restarted (torchrun --max-restarts, a requeued SLURM job) so the same command line continues it")
    a("--seed", type=int, default=0, metavar="N",
      help="the seed of everything random (initial weights, data order, synthetic data): same seed, same run")
    a("--timeout-s", type=float, default=300.0, metavar="SECONDS",
      help="seconds a process waits for a silent peer before giving up (a crashed peer stops the job after this)")
    a("--log-every", type=int, default=10, metavar="STEPS", help="print the loss every this many steps (and add it to metrics.jsonl)")
    a("--workers", type=int, default=0, metavar="N", help="background processes per training process that load data (0: none)")
    return p


def _launched_externally() -> bool:
    return any(name in os.environ for name in _LAUNCHER_VARS)


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Everything that can be checked before any process group exists; raises :class:`UsageError`."""
    positive = {"--epochs": args.epochs, "--batch-size": args.batch_size, "--log-every": args.log_every}
    positive.update({"--grad-accum": args.grad_accum})
    positive.update({"--clip-grad": args.clip_grad} if args.clip_grad is not None else {})
    positive.update({"--max-steps": args.max_steps} if args.max_steps is not None else {})
    positive.update({"--nproc": args.nproc} if args.nproc is not None else {})
    positive.update({"--synthetic-size": args.synthetic_size, "--timeout-s": args.timeout_s})
    for flag, value in positive.items():
        if value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if args.save_every < 0 or args.workers < 0:
        raise UsageError("--save-every and --workers must not be negative")
    if args.batch_size % world_size:
        raise UsageError(
            f"--batch-size {args.batch_size} is the global batch, and {world_size} ranks do not divide it "
            f"evenly; use a multiple of {world_size}, e.g. {max(1, args.batch_size // world_size) * world_size}"
        )
    if args.data == "mnist":
        if not args.data_dir:
            raise UsageError("--data mnist needs --data-dir DIR (the folder that holds MNIST/raw)")
        if not args.download and not os.path.isdir(args.data_dir):
            raise UsageError(
                f"MNIST folder {args.data_dir} does not exist; pass --download to fetch MNIST into it, "
                "or point --data-dir at the folder that holds MNIST/raw"
            )
    if (args.resume or args.save_every or args.keep_checkpoints) and not args.checkpoint_dir:
        raise UsageError("--resume, --save-every and --keep-checkpoints need --checkpoint-dir DIR")
    if args.resume == "always" and not os.path.exists(os.path.join(args.checkpoint_dir, LAST)):
        raise UsageError(
            f"--resume: no checkpoint to resume from at {os.path.join(args.checkpoint_dir, LAST)} "
            "(--resume auto starts fresh when there is none)"
        )
    _check_zero(args)
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise UsageError("--backend nccl needs CUDA GPUs, and none is visible; use --backend gloo on CPU")
        if args.nproc is not None and args.nproc > torch.cuda.device_count():
            raise UsageError(
                f"--nproc {args.nproc} with --backend nccl needs one GPU per rank; "
                f"{torch.cuda.device_count()} visible"
            )


def _check_zero(args: argparse.Namespace) -> None:
    """The combinations ``--zero`` cannot work with."""
    if args.zero == 2 and args.ddp != "mini":
        raise UsageError(
            f"--zero 2 shards the gradients by making MiniDDP reduce-scatter its buckets; --ddp {args.ddp} has "
            "no such hook: use --ddp mini, or --zero 1 (optimizer state only)"
        )
    if args.zero == 3 and args.ddp != "mini":
        raise UsageError(
            f"--zero 3 replaces the DDP wrapper by minddp.fsdp.fully_shard, so --ddp {args.ddp} would not be used: "
            "leave --ddp at mini (the default), or use --zero 1 with --ddp torch"
        )
    if args.zero == 3 and args.sync_bn:
        raise UsageError("--zero 3 with --sync-bn is not supported (not tested): use --zero 2, or drop --sync-bn")
    if args.zero and args.amp and args.backend == "nccl":
        # On CUDA, --amp means float16 with a GradScaler, which unscales and checks each
        # parameter's .grad; the sharded optimizer steps from its own copy of the gradients.
        raise UsageError(
            f"--zero {args.zero} with --amp on CUDA (float16 with loss scaling) is not supported: the loss "
            "scaler unscales .grad, but ZeRO steps from its sharded copy of the gradients; "
            "use --zero 0 with --amp, or --zero without --amp"
        )


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _run_in_this_process(args: argparse.Namespace, explicit_world: bool) -> int:
    """Be one rank: of a torchrun/srun/mpirun job, or the only rank of ``--nproc 1``.

    Bad input is reported by rank 0 alone (every rank sees the same). A rank
    that raises prints its own traceback once; a rank whose collective failed
    because a peer died prints one line, since the peer's error is the news.
    """
    if explicit_world:
        rank, world_size, local_rank = 0, 1, 0
        init = {"rank": 0, "world_size": 1, "env": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}}
    else:
        try:
            info = detect_launch()
        except RuntimeError as exc:
            _say(f"error: {exc}")
            return 2
        rank, world_size, local_rank, init = info.rank, info.world_size, info.local_rank, {}
    code = 0
    try:
        check_args(args, world_size)
        init_distributed(args.backend, timeout_s=args.timeout_s, **init)
        train(args, rank, world_size, local_rank)
    except (UsageError, CheckpointError) as exc:
        if rank == 0:
            _say(f"error: {exc}")
        code = 2
    except KeyboardInterrupt:
        _say(f"rank {rank} interrupted")
        code = 130
    except BaseException as exc:  # noqa: BLE001 -- reported here, then a non-zero exit
        if world_size > 1 and is_communication_error(exc):
            _say(f"rank {rank} stopped: a peer failed ({describe_exception(exc)})")
        else:
            _say(f"rank {rank} failed:\n{traceback.format_exc().rstrip()}")
        code = 1
        if world_size > 1:
            # Skip the orderly teardown: with a dead peer it may block.
            sys.stdout.flush()
            os._exit(code)
    if code == 0:
        shutdown()  # every rank finished: leave together
    else:
        shutdown(wait_for_peers=False)  # a usage error, possibly on one rank only: no barrier
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nproc is None and _launched_externally():
        return _run_in_this_process(args, explicit_world=False)
    nproc = 2 if args.nproc is None else args.nproc
    try:
        check_args(args, nproc)
    except UsageError as exc:
        _say(f"error: {exc}")
        return 2
    if nproc == 1:  # no child process: simplest to debug (pdb, profilers)
        return _run_in_this_process(args, explicit_world=True)
    return run_local(args, nproc)
