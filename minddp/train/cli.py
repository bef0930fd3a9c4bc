"""``minddp-train``: train an MNIST model with MiniDDP (or torch's DDP), on one machine or many.

How it starts, in order of precedence:

* ``--nproc N`` given: spawn ``N`` local processes (any launcher variables in
  the environment are ignored). This is what you run on a laptop.
* Under ``torchrun``, ``srun`` or ``mpirun`` (and no ``--nproc``): this process
  is one rank; rank and world size come from the launcher
  (:func:`minddp.launch.detect_launch`). See ``scripts/`` for the commands.
* Neither: spawn 2 local processes.

The files behind it: this one parses and checks the command line and reports
failures; :mod:`minddp.train.loop` is one rank's training;
:mod:`minddp.train.local` starts local ranks and tells which one failed first.

Exit codes: 0 done, 1 a rank failed, 2 bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

from minddp.launch import detect_launch, find_free_port, init_distributed, shutdown
from minddp.train.checkpoint import LAST, CheckpointError
from minddp.train.errors import UsageError, describe_exception, is_communication_error
from minddp.train.local import run_local
from minddp.train.loop import train

__all__ = ["main", "build_parser", "UsageError", "check_args"]

PROG = "minddp-train"
# Environment variables that mean "a launcher started this process".
_LAUNCHER_VARS = ("RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train an MNIST model data-parallel with MiniDDP; crash-safe checkpoints, exact resume.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a("--model", choices=["ae", "cnn", "resnet", "mlp"], default="ae", help="ae: autoencoder; cnn, resnet: small classifiers; mlp: a wide MLP (see minddp.models)")
    a("--data", choices=["synthetic", "mnist"], default="synthetic", help="synthetic runs offline")
    a("--data-dir", default=None, help="folder that holds (or will hold, with --download) MNIST")
    a("--download", action="store_true", help="download MNIST into --data-dir first (rank 0 only)")
    a("--synthetic-size", type=int, default=2048, help="number of synthetic training images")
    a("--ddp", choices=["mini", "torch"], default="mini", help="MiniDDP or torch's DistributedDataParallel")
    a("--nproc", type=int, default=None, help="spawn this many local processes (default 2 without a launcher)")
    a("--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: one GPU per rank")
    a("--epochs", type=int, default=1)
    a("--max-steps", type=int, default=None, help="stop after this many optimizer steps in total")
    a("--batch-size", type=int, default=64, help="GLOBAL batch size, split evenly over the ranks")
    a("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    a(
        "--lr-scaling",
        choices=["none", "linear"],
        default="none",
        help="linear: multiply --lr by the world size (the linear scaling rule, taking --lr as tuned for one rank)",
    )
    a("--amp", action="store_true", help="mixed precision: bfloat16 on CPU, float16 + GradScaler on CUDA")
    a("--sync-bn", action="store_true", help="BatchNorm statistics over the global batch (SyncBatchNorm)")
    a("--checkpoint-dir", default=None, help="write DIR/last.pt (atomically) here")
    a("--save-every", type=int, default=0, help="also save every this many steps (0: only at the end)")
    a("--keep-checkpoints", action="store_true", help="keep DIR/step-N.pt beside last.pt")
    a("--resume", action="store_true", help="continue from --checkpoint-dir/last.pt")
    a("--seed", type=int, default=0)
    a("--timeout-s", type=float, default=300.0, help="process-group timeout: how long a rank waits for a silent peer")
    a("--log-every", type=int, default=10, help="progress line every this many steps (rank 0)")
    a("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    return p


def _launched_externally() -> bool:
    return any(name in os.environ for name in _LAUNCHER_VARS)


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Everything that can be checked before any process group exists; raises :class:`UsageError`."""
    positive = {"--epochs": args.epochs, "--batch-size": args.batch_size, "--log-every": args.log_every}
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
    if args.resume and not os.path.exists(os.path.join(args.checkpoint_dir, LAST)):
        raise UsageError(f"--resume: no checkpoint to resume from at {os.path.join(args.checkpoint_dir, LAST)}")
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise UsageError("--backend nccl needs CUDA GPUs, and none is visible; use --backend gloo on CPU")
        if args.nproc is not None and args.nproc > torch.cuda.device_count():
            raise UsageError(
                f"--nproc {args.nproc} with --backend nccl needs one GPU per rank; "
                f"{torch.cuda.device_count()} visible"
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
    elif dist.is_initialized():
        dist.destroy_process_group()  # a usage error, possibly on one rank only: no barrier
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
