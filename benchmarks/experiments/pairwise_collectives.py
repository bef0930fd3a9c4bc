"""ZeRO's two collectives on Gloo: torch's own against ``minddp.zero.pairwise`` (an exchange, or sends and receives).

    python benchmarks/experiments/pairwise_collectives.py                  # 2 ranks, 0.45 MB and 1.9 MB buffers
    python benchmarks/experiments/pairwise_collectives.py --world-size 3 --rounds 15 --text docs/pairwise_collectives.txt

For each buffer size (float32 elements, a multiple of N), per call: the CPU
time of this process (``time.process_time``: Gloo's threads included) and the
wall time, the slowest rank. Each round times ``--calls`` calls of every
form, in an order that rotates each round; the table gives the median over
rounds with [min, max]. Forms:

* ``all_reduce``: torch's ``dist.all_reduce`` of the whole buffer (what DDP,
  and a reduce-scatter done as an all-reduce in place, send);
* ``reduce_scatter_tensor``: torch's (on Gloo: a clone, then an all-reduce);
* ``pairwise reduce-scatter``: each other rank's chunk sent to it, the
  chunks received for this rank's own added up in rank order (at two
  ranks one exchange, ``all_to_all_single`` with nothing to oneself; at
  more, sends and receives);
* ``all_gather_into_tensor``: torch's, of a 1/N piece;
* ``pairwise all-gather``: the piece sent to every other rank, theirs
  received into place (the same two ways).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),  # the repository
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # benchmarks/: benchlib

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchlib.outputs import emit, ranks_json  # noqa: E402
from minddp.zero import pairwise  # noqa: E402


def _forms(buffer: torch.Tensor, rank: int, n: int) -> dict:
    piece = buffer.numel() // n
    group = dist.group.WORLD
    out, whole = torch.empty(piece), torch.empty(buffer.numel())
    mine = buffer[rank * piece: (rank + 1) * piece].clone()
    return {
        "all_reduce": lambda: dist.all_reduce(buffer.clone()),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, buffer),
        "pairwise reduce-scatter": lambda: pairwise.reduce_scatter(buffer, piece, group, out=out).wait(),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(whole, mine),
        "pairwise all-gather": lambda: pairwise.all_gather(whole, mine, group).wait(),
    }


def rank_main(rank: int, world_size: int, args: dict, path: str) -> None:
    import json

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    results = {}
    for numel in args["sizes"]:
        buffer = torch.randn(numel - numel % world_size)
        forms = _forms(buffer, rank, world_size)
        names = list(forms)
        for name in names:  # warm up
            for _ in range(5):
                forms[name]()
        times = {name: [] for name in names}
        for round_ in range(args["rounds"]):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for name in order:
                dist.barrier()
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(args["calls"]):
                    forms[name]()
                times[name].append(((time.process_time() - cpu) * 1e3 / args["calls"],
                                    (time.perf_counter() - wall) * 1e3 / args["calls"]))
        results[numel] = times
    everyone = [None] * world_size
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def table(everyone: list[dict], args: dict) -> str:
    lines = [f"# python benchmarks/experiments/pairwise_collectives.py --world-size {args['world_size']} --rounds {args['rounds']} "
             f"--calls {args['calls']}  (Gloo, CPU, 1 thread per rank; load average {os.getloadavg()[0]:.1f})",
             "per call, slowest rank per round; median over rounds [min, max]",
             "| buffer | form | CPU ms | wall ms |", "|---|---|---:|---:|"]
    for numel in everyone[0]:
        for name in everyone[0][numel]:
            per_round = list(zip(*[r[numel][name] for r in everyone]))  # (rank's (cpu, wall)) per round
            cpu = [max(t[0] for t in ranks) for ranks in per_round]
            wall = [max(t[1] for t in ranks) for ranks in per_round]
            lines.append(f"| {int(numel) * 4 / 1e6:.2f} MB | {name} | {_cell(cpu)} | {_cell(wall)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="111840,475104", help="buffer sizes, float32 elements")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--text")
    parser.add_argument("--json")
    options = parser.parse_args()
    args = {"world_size": options.world_size, "rounds": options.rounds, "calls": options.calls,
            "sizes": [int(s) for s in options.sizes.split(",")]}
    everyone = ranks_json(rank_main, options.world_size, args)
    emit(table(everyone, args), options.text, options.json, {"args": args, "ranks": everyone})


if __name__ == "__main__":
    main()
