"""Does an all-reduce on the wire and a compute block slow each other down? Each timed alone, then side by side.

    python benchmarks/wire_beside_compute.py --mb 3.8 --buckets 13 --link 1gbit

Two ranks all-reduce ``--mb`` MB in ``--buckets`` equal buffers, launched
together (as DDP launches its buckets), and time when the last one is done:
once alone, once while the calling thread computes a fixed block of matrix
products (as many as took 25 ms alone, calibrated first, the slowest rank's
count). The compute block is also timed alone. Rank 0 prints the medians over
``--repeats``, in ms. The DDP overlap bound (benchmarks/benchlib/bound.py)
assumes the two run side by side as fast as alone; on CPU ranks with no core
to spare this shows by how much they do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from minddp.launch import spawn

BLOCK_S = 0.025  # the compute block's length alone


def _matrix_products(count: int, a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(count):
        a @ b


def _calibrate(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many products take BLOCK_S alone, the smallest count over the ranks."""
    count, end = 0, time.perf_counter() + BLOCK_S
    while time.perf_counter() < end:
        a @ b
        count += 1
    counts = torch.tensor([count])
    dist.all_reduce(counts, op=dist.ReduceOp.MIN)
    return int(counts)


def _measure(rank: int, world_size: int, megabytes: float, buckets: int, repeats: int) -> None:
    torch.set_num_threads(1)
    buffers = [torch.zeros(int(megabytes * 1e6 / 4 / buckets)) for _ in range(buckets)]
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    count = _calibrate(a, b)
    times: dict[str, list[float]] = {"all-reduce alone": [], "all-reduce beside compute": [],
                                     "compute alone": [], "compute beside all-reduce": []}
    for _ in range(repeats):
        for beside in (False, True):
            dist.barrier()
            finished: list[float] = []
            start = time.perf_counter()
            futures = [dist.all_reduce(buffer, async_op=True).get_future() for buffer in buffers]
            futures[-1].then(lambda _: finished.append(time.perf_counter()))
            if beside:
                computing = time.perf_counter()
                _matrix_products(count, a, b)
                times["compute beside all-reduce"].append(time.perf_counter() - computing)
            for future in futures:
                future.wait()
            while not finished:  # the callback runs on Gloo's thread, just after the future completes
                time.sleep(1e-4)
            times["all-reduce beside compute" if beside else "all-reduce alone"].append(finished[0] - start)
        computing = time.perf_counter()
        _matrix_products(count, a, b)
        times["compute alone"].append(time.perf_counter() - computing)
    if rank == 0:
        print(json.dumps({"mb": megabytes, "buckets": buckets, "repeats": repeats,
                          "ms_median": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}}),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=3.8, help="MB all-reduced (default 3.8: gpt's gradients)")
    parser.add_argument("--buckets", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--link", default="1gbit", help="loopback, or a rate such as 1gbit (minddp_lab/links/namespaces.py)")
    args = parser.parse_args()
    spawn(_measure, 2, args.mb, args.buckets, args.repeats, link=None if args.link == "loopback" else args.link)


if __name__ == "__main__":
    main()
