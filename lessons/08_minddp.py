"""Lesson 08: ``minddp.MiniDDP`` -- lesson 07b's wrapper, packaged, and equal to torch's DDP.

What you will learn
    ``MiniDDP`` is the wrapper you grew in lessons 04-07b, finished:

    * at construction it broadcasts rank 0's parameters *and buffers* (07b);
    * post-accumulate hooks (05) copy each gradient, already divided by the
      world size, into its slot of a persistent flat bucket (07b);
    * full buckets are all-reduced asynchronously, strictly in order (07),
      while backward goes on (06);
    * an end-of-backward callback waits for them (07b): when
      ``loss.backward()`` returns, every ``.grad`` is the average;
    * after the first step buckets are rebuilt in the order gradients really
      arrived (07b);
    * ``require_sync`` became torch's ``with ddp.no_sync():``; with
      ``broadcast_buffers=True`` (the default) every synchronized forward
      first copies rank 0's buffers to all ranks.

    Its constructor takes torch's arguments, so it is a drop-in for
    ``torch.nn.parallel.DistributedDataParallel`` -- and this lesson runs
    both on the same test bench as lessons 04-07b.

What to run
    python lessons/08_minddp.py [--world-size 3] [--bucket-cap-mb 25]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    The test bench's table for MiniDDP and torch's DDP (both exact, with
    accumulation through ``no_sync``); the buckets MiniDDP built, in launch
    order, and when the first one left; and the BatchNorm buffers made
    equal at construction. Then read ``minddp/ddp.py``: its docstring traces
    a gradient's path through exactly these steps.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict the order of the names in bucket 0.
    2. ``--bucket-cap-mb 25`` (torch's default): predict how many buckets and
       whether the first one still leaves before the last gradient.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from _common import is_exact, parse_args, print0, print_ranks, print_results, run, train_and_compare


def show_buffers(rank: int) -> None:
    model = nn.Sequential(nn.Linear(20, 8), nn.BatchNorm1d(8))
    model[1].running_mean.fill_(float(rank))  # different on purpose: construction must fix it
    before = model[1].running_mean[0].item()
    MiniDDP(model)
    print0("\nBatchNorm's running mean, before -> after MiniDDP(model):")
    print_ranks(f"{before:+.1f} -> {model[1].running_mean[0].item():+.1f}")
    assert model[1].running_mean[0].item() == 0.0, "rank 0's buffers everywhere"


def main(rank: int, world_size: int, args) -> None:
    cap = args.bucket_cap_mb  # 0.02 MiB ~ 20 KB: several buckets even for a small model
    variants = [("MiniDDP", lambda m: MiniDDP(m, bucket_cap_mb=cap)), ("torch DDP", lambda m: TorchDDP(m, bucket_cap_mb=cap))]
    results, wrappers = [], []
    for k in (1, 2):
        for name, wrap in variants:
            result, ddp = train_and_compare(f"{name}, {k} micro-batch(es)", wrap, rank, world_size, micro_batches=k)
            results.append(result)
            wrappers.append(ddp)
    print0(f"{world_size} ranks on the test bench of lessons 04-07b:")
    print_results(results)

    ours = wrappers[0]
    print0(f"\nMiniDDP's buckets after the first step, in launch order ({len(ours.bucket_names)} buckets):")
    for i, names in enumerate(ours.bucket_names):
        print0(f"  bucket {i}: {', '.join(names)}")
    tl = ours.timeline
    print0(f"last step: first bucket launched {(tl.launches[0] - tl.first_hook) * 1e3:.2f} ms after the first hook; "
           f"last hook at {(tl.last_hook - tl.first_hook) * 1e3:.2f} ms")
    show_buffers(rank)

    assert all(is_exact(r) for r in results), f"every row exact expected, got {results}"
    assert ours.bucket_names[0][:2] == ["4.bias", "4.weight"], (
        f"the learned order starts with the last layer's bias, then its weight; bucket 0 is {ours.bucket_names[0]}")
    several = len(ours.bucket_names) > 1
    assert several == (tl.launches[0] < tl.last_hook), "a first bucket leaves early exactly when there are several"
    print0("\nchecked: MiniDDP and torch's DDP are both exact on the bench, with and without")
    print0("         accumulation; the learned order starts with the last layer's bias;")
    print0("         " + ("the first bucket left before the last gradient hook;" if several else
                         "one bucket, launched only with the last gradient;") + " construction fixed the buffers.")


def options(parser) -> None:
    parser.add_argument("--bucket-cap-mb", type=float, default=0.02, help="bucket cap in MiB (default %(default)s)")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args)
