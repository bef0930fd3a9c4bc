"""The parts of one rank's run, built from the command line: data, device, wrapper, and the failure hook.

Test hook: ``MINDDP_TEST_FAIL=RANK:STEP:HOW`` makes rank ``RANK`` fail just
before step ``STEP`` (1-based), ``HOW`` being ``kill`` (SIGKILL itself),
``raise`` (a RuntimeError) or ``exit`` (``os._exit(3)``). With
``MINDDP_TEST_FAIL_ONCE=PATH`` it fails only if ``PATH`` does not exist, and
creates it first: a job restarted by its launcher then runs through. Only the
tests use them.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from minddp_lab.data import SyntheticMNIST, make_dataset
from minddp.ddp.wrapper import MiniDDP
from minddp.sync_batchnorm import SyncBatchNorm
from minddp_lab.train.errors import UsageError
from minddp_lab.train.fully_sharded import shard_model

__all__ = ["failure_hook", "training_set", "held_out_set", "pick_device", "wrap", "convert_sync_bn"]

# The synthetic held-out split is this fraction of --synthetic-size.
HELD_OUT_FRACTION = 4


def failure_hook(rank: int) -> Callable[[int], None]:
    spec = os.environ.get("MINDDP_TEST_FAIL")
    if not spec:
        return lambda step: None
    fail_rank, fail_step, how = spec.split(":")
    if int(fail_rank) != rank:
        return lambda step: None
    once_marker = os.environ.get("MINDDP_TEST_FAIL_ONCE")

    def hook(step: int) -> None:
        if step != int(fail_step):
            return
        if once_marker:
            if os.path.exists(once_marker):
                return
            open(once_marker, "w").close()
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"MINDDP_TEST_FAIL: rank {rank} fails before step {step} on purpose")

    return hook


def _mnist(args: argparse.Namespace, train: bool) -> Dataset:
    try:
        # With --download, rank 0 fetches (both splits) while the others wait at a barrier.
        return make_dataset("mnist", root=args.data_dir, train=train, download=args.download and train)
    except (RuntimeError, OSError) as exc:  # its message says what is missing and how to get it
        raise UsageError(str(exc).strip().replace("\n", " ")) from None


def training_set(args: argparse.Namespace) -> Dataset:
    if args.data == "synthetic":
        return SyntheticMNIST(size=args.synthetic_size, seed=args.seed, train=True)
    return _mnist(args, train=True)


def held_out_set(args: argparse.Namespace) -> Dataset:
    """Samples never trained on: MNIST's test set, or a synthetic split a quarter the training size."""
    if args.data == "synthetic":
        return SyntheticMNIST(size=max(1, args.synthetic_size // HELD_OUT_FRACTION), seed=args.seed, train=False)
    return _mnist(args, train=False)


def pick_device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if args.backend == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def wrap(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    if args.zero == 3:  # no DDP wrapper: the model itself, fully sharded
        return shard_model(model)
    if args.ddp == "torch":
        return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    return MiniDDP(model)


def convert_sync_bn(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    # torch's SyncBatchNorm only synchronizes on GPUs (it raises on CPU tensors),
    # so on CPU both --ddp choices use minddp's, which works on any device.
    if args.ddp == "torch" and device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return SyncBatchNorm.convert_sync_batchnorm(model)
