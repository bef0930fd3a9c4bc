"""The little every lesson shares: its command line, starting ranks, printing.

Kept tiny on purpose, so that each lesson still reads top to bottom. From
lesson 02 on, ranks are started with ``minddp.launch.spawn``, which wraps
``torch.multiprocessing.spawn`` (lesson 02 shows how it works underneath).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from minddp.launch import spawn


def parse_args(doc: str, world_size: int = 2, extra=None) -> argparse.Namespace:
    """``--world-size N`` (default 2), plus whatever ``extra(parser)`` adds."""
    first_line = (doc or "").strip().splitlines()[0] if doc else None
    parser = argparse.ArgumentParser(description=first_line)
    parser.add_argument("--world-size", type=int, default=world_size, help="number of processes (default %(default)s)")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def _entry(rank: int, world_size: int, fn, args: tuple) -> None:
    # Two processes on a laptop each spawning a thread per core would fight
    # over the same cores; one thread each keeps timings honest and runs fast.
    torch.set_num_threads(1)
    fn(rank, world_size, *args)


def run(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks."""
    spawn(_entry, world_size, fn, args, backend="gloo")


def print_ranks(text: str) -> None:
    """Every rank passes one line; rank 0 prints them all, in rank order.

    Plain ``print`` from several processes interleaves at random. Gathering
    the lines first makes the output the same on every run.
    """
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, text)
    if dist.get_rank() == 0:
        for r, line in enumerate(lines):
            print(f"  [rank {r}] {line}", flush=True)


def print0(*args) -> None:
    """Print on rank 0 only (or when no process group is running)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)
