"""Lesson 02: spawning ranks, and the four collectives data parallelism needs.

What you will learn
    * ``torch.multiprocessing.spawn(fn, args, nprocs)`` starts ``nprocs``
      fresh Python processes and calls ``fn(i, *args)`` in each, with
      ``i = 0 .. nprocs-1``: one command instead of one terminal per rank.
    * A *collective* is a call that every rank makes, with the same shapes,
      in the same order. It returns only when its part is done. The four
      that DDP is built from:

      broadcast       one rank's tensor is copied to all     (model at start)
      all_reduce      everyone ends with the sum of all      (gradients)
      all_gather      everyone ends with everyone's tensor   (small metadata)
      reduce_scatter  the sum, but each keeps only its slice (half of a ring)

What to run
    python lessons/02_spawn_and_collectives.py [--world-size 4]

What to look at
    Each collective's tensor on every rank, before and after. Rank r starts
    with values built from r, so you can redo the arithmetic in your head.

Try this
    1. Predict every "after" column for ``--world-size 4`` before running.
    2. In ``collectives`` change ``src=0`` to ``src=1`` in the broadcast:
       predict the output and which assert fails (the one that expects rank
       0's values).
    3. Make rank 1 skip the ``all_gather`` (``if rank != 1:``) and predict.
       (Everyone else waits in it, then in the next collective the ranks
       disagree on what is being sent: a hang, or a garbled result. Lesson
       18 shows how such hangs look and end.)
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import parse_args, print0, print_ranks


def worker(rank: int, world_size: int, port: int) -> None:
    # This is what minddp.launch.spawn does for you in the later lessons:
    # set the meeting point, join the group, and always leave it at the end.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        collectives(rank, world_size)
    finally:
        dist.destroy_process_group()


def collectives(rank: int, world_size: int) -> None:
    n = world_size
    ranks_sum = n * (n - 1) // 2  # 0 + 1 + ... + (n-1)

    print0("\nbroadcast(t, src=0): rank 0's tensor overwrites everyone's")
    t = torch.tensor([1.0, 2.0, 3.0]) + 10 * rank  # rank r holds 10r + [1, 2, 3]
    before = t.tolist()
    dist.broadcast(t, src=0)
    print_ranks(f"{before} -> {t.tolist()}")
    assert t.tolist() == [1.0, 2.0, 3.0], "rank 0's values, not zeros"

    print0("\nall_reduce(t, SUM): every rank ends with the sum over ranks, in place")
    t = torch.tensor([1.0, float(rank)])
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    print_ranks(f"{before} -> {t.tolist()}")
    assert t.tolist() == [float(n), float(ranks_sum)]
    # Averaging (what gradients need) is SUM then divide: Gloo has no AVG.
    print0(f"  divide by world_size {n} and it is the mean: {(t / n).tolist()}")

    print0("\nall_gather(list, t): every rank receives every rank's tensor, in rank order")
    t = torch.tensor([float(rank), float(rank * 10)])
    out = [torch.empty(2) for _ in range(n)]
    dist.all_gather(out, t)
    print_ranks(f"{t.tolist()} -> {[o.tolist() for o in out]}")
    assert [o.tolist() for o in out] == [[float(r), float(r * 10)] for r in range(n)]

    print0("\nreduce_scatter(out, chunks): sum chunk i over ranks, rank i keeps it")
    # Rank r fills chunk i with r + i, so chunk i sums to ranks_sum + n*i
    # over the ranks, and only rank i receives that sum.
    chunks = [torch.full((2,), float(rank + i)) for i in range(n)]
    out = torch.empty(2)
    dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM)
    print_ranks(f"{[c[0].item() for c in chunks]} -> {out.tolist()}")
    assert out.tolist() == [float(ranks_sum + n * rank)] * 2

    # The identity lesson 03 is built on: reduce_scatter followed by
    # all_gather of the pieces is the same as one all_reduce.
    x = torch.arange(2 * n, dtype=torch.float32) * (rank + 1)
    piece = torch.empty(2)
    dist.reduce_scatter(piece, list(x.chunk(n)))
    pieces = [torch.empty(2) for _ in range(n)]
    dist.all_gather(pieces, piece)
    reference = x.clone()
    dist.all_reduce(reference)
    assert torch.equal(torch.cat(pieces), reference)
    print0("\nchecked: every result above, and reduce_scatter + all_gather == all_reduce")


if __name__ == "__main__":
    args = parse_args(__doc__)
    with socket.socket() as s:  # a free port, chosen by the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn pickles `worker` by name, so it must live at module level; the
    # children re-import this file (that is why the __main__ guard matters).
    mp.spawn(worker, args=(args.world_size, port), nprocs=args.world_size, join=True)
