"""What a wrapper costs per parameter tensor: a chain of N tiny ``Linear`` layers, MiniDDP against torch's DDP.

    python benchmarks/per_parameter_cost.py                     # N = 32, 128, 512, 2048; 5 rounds
    python benchmarks/per_parameter_cost.py --layers 32,2048 --rounds 9 --repo OTHER_CHECKOUT

Each layer is ``Linear(4, 4)``: two parameter tensors of a few bytes, so a
step is almost all per-tensor work (autograd's, the hooks', the buckets'),
and a wrapper's cost per tensor shows as the slope of step time against N.
Both wrappers run on 2 Gloo ranks, one thread each, with a comm hook that
returns the bucket unreduced (as ``benchmarks/benchlib/wrappers.return_bucket``),
so no all-reduce is timed: what is left is the wrapper (the hook is written here
again, so that ``--repo`` can name a checkout of another layout). Each round runs every
(wrapper, N) once, in an order that alternates between rounds, and reports
the median of its timed steps; the table gives, per cell, the median over
rounds and the spread (min-max) of the round medians. ``--repo`` imports
minddp from another checkout (an earlier commit, to compare with).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def return_bucket(state, bucket):
    """A communication hook that communicates nothing: the bucket, at once (both wrappers take it)."""
    import torch

    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def step_ms(wrapper: str, layers: int, steps: int, repo: str) -> float:
    """The median step time (ms) of one wrapper on one chain, on 2 ranks (rank 0's)."""
    import torch.multiprocessing as mp

    out = mp.get_context("spawn").Queue()
    port = 29500 + (os.getpid() % 1000) + layers % 97
    procs = [mp.get_context("spawn").Process(target=_rank, args=(r, port, wrapper, layers, steps, repo, out))
             for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join()
    return result


def _rank(rank: int, port: int, wrapper: str, layers: int, steps: int, repo: str, out) -> None:
    sys.path[:0] = [repo]
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))
    if wrapper == "minddp":
        from minddp import MiniDDP
        ddp = MiniDDP(model)
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, return_bucket)
    x = torch.randn(8, 4)
    times = []
    for i in range(steps + 5):
        start = time.perf_counter()
        ddp(x).sum().backward()
        for p in model.parameters():
            p.grad = None
        if i >= 5:  # the first backwards learn the bucket order and rebuild
            times.append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        out.put(statistics.median(times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="32,128,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repo", default=os.path.dirname(HERE), help="the checkout minddp is imported from")
    args = parser.parse_args()
    sizes = [int(n) for n in args.layers.split(",")]
    cells = [(w, n) for n in sizes for w in ("minddp", "torch")]
    medians: dict[tuple, list[float]] = {cell: [] for cell in cells}
    for r in range(args.rounds):
        for cell in (cells if r % 2 == 0 else list(reversed(cells))):  # interleaved, the order alternating
            medians[cell].append(step_ms(*cell, args.steps, args.repo))
    print(f"python benchmarks/per_parameter_cost.py --layers {args.layers} --rounds {args.rounds} "
          f"--steps {args.steps}; {time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.1f}")
    print(f"{'layers':>7} {'tensors':>8} | {'MiniDDP ms (spread)':>24} | {'torch DDP ms (spread)':>24} | ratio")
    for n in sizes:
        row = []
        for w in ("minddp", "torch"):
            values = medians[(w, n)]
            row.append(f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})")
        ratio = statistics.median(medians[("minddp", n)]) / statistics.median(medians[("torch", n)])
        print(f"{n:>7} {2 * n:>8} | {row[0]:>24} | {row[1]:>24} | {ratio:.2f}")


if __name__ == "__main__":
    main()
