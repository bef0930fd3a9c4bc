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
                      (or the mean: ``ReduceOp.AVG``)
      all_gather      everyone ends with everyone's tensor   (small metadata)
      reduce_scatter  the sum, but each keeps only its slice (half of a ring)

What to run
    python lessons/02_spawn_and_collectives.py [--world-size 4] [--src 1] [--rank-1-skips-all-gather]

What to look at
    Each collective's tensor on every rank, before and after. Rank r starts
    with values built from r, so you can redo the arithmetic in your head.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict every "after" column for ``--world-size 4`` before running.
    2. ``--src 1`` broadcasts from rank 1 instead of rank 0: predict every
       rank's "after".
    3. ``--rank-1-skips-all-gather`` makes rank 1 skip the ``all_gather``
       (``if rank != 1:``): predict.
"""

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import parse_args, print0, print_ranks


# The broken run of exercise 3 waits at most this long in any collective, so
# that a hang, had it been one, would end as an error the lesson can report.
BROKEN_RUN_TIMEOUT_S = 120


def worker(rank: int, world_size: int, port: int, rank_1_skips: bool = False, src: int = 0) -> None:
    # This is what minddp.launch.spawn does for you in the later lessons:
    # set the meeting point, join the group, and always leave it at the end.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=BROKEN_RUN_TIMEOUT_S) if rank_1_skips else None
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    try:
        collectives(rank, world_size, rank_1_skips, src)
    finally:
        dist.destroy_process_group()


def collectives(rank: int, world_size: int, rank_1_skips: bool = False, src: int = 0) -> None:
    n = world_size
    ranks_sum = n * (n - 1) // 2  # 0 + 1 + ... + (n-1)

    print0(f"\nbroadcast(t, src={src}): rank {src}'s tensor overwrites everyone's")
    t = torch.tensor([1.0, 2.0, 3.0]) + 10 * rank  # rank r holds 10r + [1, 2, 3]
    before = t.tolist()
    dist.broadcast(t, src=src)
    print_ranks(f"{before} -> {t.tolist()}")
    expected = [10.0 * src + 1, 10.0 * src + 2, 10.0 * src + 3]
    assert t.tolist() == expected, f"expected rank {src}'s values {expected}, saw {t.tolist()}"

    print0("\nall_reduce(t, SUM): every rank ends with the sum over ranks, in place")
    t = torch.tensor([1.0, float(rank)])
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    print_ranks(f"{before} -> {t.tolist()}")
    assert t.tolist() == [float(n), float(ranks_sum)]
    # Averaging (what gradients need) is SUM then divide by the world size;
    # ReduceOp.AVG does both in one call (Gloo has it for floating-point
    # tensors; an integer tensor cannot hold a mean and is refused).
    summed_then_divided = (t / n).tolist()
    t = torch.tensor([1.0, float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    print0(f"  divided by world_size {n}: {summed_then_divided}; all_reduce(t, AVG) gives {t.tolist()}")
    assert t.tolist() == summed_then_divided, f"AVG is SUM / world_size: expected {summed_then_divided}, saw {t.tolist()}"

    print0("\nall_gather(list, t): every rank receives every rank's tensor, in rank order")
    t = torch.tensor([float(rank), float(rank * 10)])
    out = [torch.empty(2) for _ in range(n)]
    if rank_1_skips and rank == 1:
        pass  # exercise 3: rank 1 goes straight on to the next collective
    else:
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


def run_with_rank_1_skipping(world_size: int, port: int) -> None:
    """Exercise 3: run the broken variant and report how it ended."""
    try:
        mp.spawn(worker, args=(world_size, port, True), nprocs=world_size, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        text = str(error)
        first_line = next(line for line in text.splitlines() if line.strip())
        print(f"\n--rank-1-skips-all-gather: the run failed: {first_line}")
        print(f"  {text.strip().splitlines()[-1][:300]}")
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        assert not timed_out, f"expected a crash, not a hang ended by the timeout; saw: {text[-2000:]}"
        print(f"checked: no hang -- the run crashed; no rank waited out the {BROKEN_RUN_TIMEOUT_S} s timeout.")
        return
    raise AssertionError("expected the run with rank 1 skipping the all_gather to fail; it finished")


if __name__ == "__main__":
    def options(parser):
        parser.add_argument("--src", type=int, default=0, help="exercise 2: the rank the broadcast copies from")
        parser.add_argument("--rank-1-skips-all-gather", action="store_true", help="exercise 3: rank 1 skips the all_gather")
    args = parse_args(__doc__, extra=options)
    if not 0 <= args.src < args.world_size:
        raise SystemExit(f"--src {args.src}: there is no such rank in a world of {args.world_size}")
    if args.rank_1_skips_all_gather and args.world_size < 2:
        raise SystemExit("--rank-1-skips-all-gather needs a rank 1: run it with --world-size 2 or more")
    with socket.socket() as s:  # a free port, chosen by the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn pickles `worker` by name, so it must live at module level; the
    # children re-import this file (that is why the __main__ guard matters).
    if args.rank_1_skips_all_gather:
        run_with_rank_1_skipping(args.world_size, port)
    else:
        mp.spawn(worker, args=(args.world_size, port, False, args.src), nprocs=args.world_size, join=True)
