"""Where a step's time goes, torch's DDP beside MiniDDP: forward, ``loss.backward()``, its thread's CPU, the optimizer.

    python benchmarks/step_parts.py --model gpt --bucket-cap-mb 0.25 --link 1gbit

Two ranks train both wrappers (same model, same data, the same cap) in
alternating blocks (torch first in even blocks, MiniDDP first in odd ones),
and rank 0 prints, per wrapper, the median over every timed step of: the
whole step, ``zero_grad``, forward with the loss, the ``loss.backward()``
call (DDP waits there for the last bucket), the CPU time of the thread that
ran it (``time.thread_time``: backward's compute and the hooks, not the
waiting), and the optimizer step. ``--link``: loopback, or every rank in a
network namespace of its own on links shaped to that rate (root). The cap
of 25 MB is both wrappers' default, no cap given (the first bucket 1 MiB),
as in ``compare.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import torch.distributed as dist
from minddp import MiniDDP
from minddp.launch import spawn

from benchlib import models
from benchlib.wrappers import cap_argument

PARTS = ("step", "zero_grad", "forward", "backward", "backward_cpu", "optimizer")


def _timed_step(wrapped, optimizer, name: str, batch) -> tuple[float, ...]:
    """Seconds of each of PARTS for one step."""
    inputs, targets = batch
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    zeroed = time.perf_counter()
    loss = models.loss(name, wrapped, inputs, targets)
    forward_done, cpu = time.perf_counter(), time.thread_time()
    loss.backward()
    backward_done, cpu = time.perf_counter(), time.thread_time() - cpu
    optimizer.step()
    end = time.perf_counter()
    return end - start, zeroed - start, forward_done - zeroed, backward_done - forward_done, cpu, end - backward_done


def _measure(rank: int, world_size: int, name: str, cap_mb: float, blocks: int, steps: int, warmup: int) -> None:
    torch.set_num_threads(1)
    data = models.batches(name, rank, torch.device("cpu"))
    wrappers = {}
    for kind, wrap in (("torch", TorchDDP), ("minddp", MiniDDP)):
        torch.manual_seed(0)
        wrappers[kind] = wrap(models.build(name), bucket_cap_mb=cap_argument(cap_mb))
    optimizers = {kind: torch.optim.SGD(w.parameters(), lr=1e-3) for kind, w in wrappers.items()}
    times = {kind: {part: [] for part in PARTS} for kind in wrappers}
    for kind in wrappers:
        for i in range(warmup):
            _timed_step(wrappers[kind], optimizers[kind], name, data[i % len(data)])
    for block in range(blocks):
        for kind in ("torch", "minddp") if block % 2 == 0 else ("minddp", "torch"):
            dist.barrier()
            for i in range(steps):
                parts = _timed_step(wrappers[kind], optimizers[kind], name, data[i % len(data)])
                for part, seconds in zip(PARTS, parts):
                    times[kind][part].append(seconds)
    if rank == 0:
        medians = {kind: {part: round(statistics.median(v) * 1e3, 2) for part, v in t.items()}
                   for kind, t in times.items()}
        print(json.dumps({"model": name, "bucket_cap_mb": cap_mb, "ms_median": medians,
                          "minddp_buckets": len(wrappers["minddp"].reducer.buckets)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt", choices=models.ALL_MODELS)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="25 (default): no cap given, torch's default")
    parser.add_argument("--link", default="loopback", help="loopback, or a rate such as 1gbit (minddp_lab/links/namespaces.py)")
    parser.add_argument("--blocks", type=int, default=10, help="alternating blocks (default 10)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block and wrapper (default 5)")
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    spawn(_measure, 2, args.model, args.bucket_cap_mb, args.blocks, args.steps, args.warmup,
          link=None if args.link == "loopback" else args.link)


if __name__ == "__main__":
    main()
